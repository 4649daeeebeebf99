"""SamplingParams with SGLang's names, validated with errors that name the bad field: strict types (a bool
is not a number, null is not a value), finite floats in range, integers within what the kernels take."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MIN_TEMPERATURE = 1e-6  # below it (but > 0) logits / temperature leaves float32: refused, as are NaN and Inf
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1  # torch.Generator seeds are 64-bit unsigned
MAX_STOP_STRINGS = 64
NULLABLE = ("seed", "speculative_num_draft_tokens")  # None means "the default" for these only


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    speculative_num_draft_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling_params key(s): {', '.join(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for key in ("stop", "stop_token_ids"):
            if d.get(key) is None:
                d.pop(key, None)
        params = cls(**d)
        params.verify(vocab_size)
        return params

    def verify(self, vocab_size: int | None = None) -> None:
        """ValueError naming the first bad field; `vocab_size` bounds top_k and stop_token_ids."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling_params.{name} {why}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None and f.name not in NULLABLE:
                raise bad(f.name, "must not be null")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in floats:
            if not is_number(getattr(self, name)):
                raise bad(name, "must be a finite number")
        if not 0 <= self.temperature <= MAX_TEMPERATURE or 0 < self.temperature < MIN_TEMPERATURE:
            raise bad("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        top_k_max = vocab_size if vocab_size is not None else 2**31 - 1
        if not is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= top_k_max):
            raise bad("top_k", f"must be -1 (disabled) or an integer in [1, {top_k_max}]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", "must be an integer in [0, 2**64 - 1]")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must be a string or a list of at most {MAX_STOP_STRINGS} strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        id_max = vocab_size if vocab_size is not None else 2**31
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and 0 <= t < id_max for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", f"must be a list of token ids in [0, {id_max})")
        n = self.speculative_num_draft_tokens
        if n is not None and (not is_int(n) or not 1 <= n <= 1024):
            raise bad("speculative_num_draft_tokens", "must be an integer in [1, 1024]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
