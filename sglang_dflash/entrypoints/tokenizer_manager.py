"""TokenizerManager: THE request builder. Turns user input (text, chat messages or ids + sampling params)
into Reqs for the offline Engine, the HTTP server and response regeneration alike, with the checks that
make bad input a clear ValueError (an HTTP 400) before anything is allocated."""

from __future__ import annotations

import uuid

from transformers import PreTrainedTokenizerBase

from sglang_dflash.runtime.tokenizer import IncrementalDetokenizer, apply_chat_template
from sglang_dflash.sampling.sampling_params import SamplingParams, is_int
from sglang_dflash.scheduler.schedule_batch import Req


def check_text(text: object, name: str) -> str:
    """`text` if it is a string UTF-8 can encode (no lone UTF-16 surrogate such as "\\ud800")."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate {text[e.start]!r} at {e.start}") from None
    return text


class TokenizerManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_length: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, name: str = "prompt") -> list[int]:
        return self.tokenizer.encode(check_text(text, name), add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(m, dict) and m.get("content") is not None:
                check_text(m["content"], f"messages[{i}].content")
        return apply_chat_template(self.tokenizer, messages)

    def make_req(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: dict | SamplingParams | None = None,
        rid: str | None = None,
    ) -> Req:
        params = sampling_params
        if isinstance(params, SamplingParams):
            params.verify(self.vocab_size)
        else:
            params = SamplingParams.from_dict(params, self.vocab_size)
        if input_ids is None:
            if prompt is None:
                raise ValueError("prompt must be a string (or pass input_ids)")
            input_ids = self.encode(prompt)
        if not isinstance(input_ids, list):
            raise ValueError("input_ids must be a list of token ids")
        if not input_ids:
            raise ValueError("prompt is empty")
        if not all(is_int(t) and 0 <= t < self.vocab_size for t in input_ids):
            raise ValueError(f"input_ids must be integers in [0, {self.vocab_size})")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError("rid must be a non-empty string")
        total = len(input_ids) + params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{total} tokens ({len(input_ids)} in the prompt, {params.max_new_tokens} for the completion). "
                "Please reduce the length of the prompt or of max_tokens."
            )
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return Req(rid or uuid.uuid4().hex, input_ids, params, detok, self.eos_token_ids, self.context_length)
