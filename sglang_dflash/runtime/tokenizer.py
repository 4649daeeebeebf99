"""Tokenizer loading, chat template, and incremental detokenisation that never emits broken UTF-8."""

from __future__ import annotations

from pathlib import Path

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a 'role' and a string 'content'")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:  # the model's template refuses these messages (e.g. no user turn)
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (from `prefix_offset`) so each step costs O(window), and holds back
    text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token completes it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def append(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the newly completed text."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
