"""TokenizerManager: turns user input (text, chat messages or ids + sampling params) into Reqs,
with the checks that make bad input a clear ValueError before anything is allocated."""

from __future__ import annotations

import uuid

from transformers import PreTrainedTokenizerBase

from sglang_dflash.engine.sampling_params import SamplingParams
from sglang_dflash.engine.tokenizer import IncrementalDetokenizer, apply_chat_template
from sglang_dflash.scheduler.schedule_batch import Req


class TokenizerManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_length: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def make_req(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: dict | SamplingParams | None = None,
        rid: str | None = None,
    ) -> Req:
        params = sampling_params
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        if input_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass input_ids)")
            input_ids = self.encode(prompt)
        if not input_ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids):
            raise ValueError(f"input_ids must be integers in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(input_ids)} tokens, the context length is {self.context_length}"
            )
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        return Req(rid or uuid.uuid4().hex, input_ids, params, detok, self.eos_token_ids, self.context_length)
