"""ServerArgs: every engine and server option, with SGLang's names and checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sglang_dflash.device import has_fast_bf16

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    context_length: int | None = None
    max_total_tokens: int = 32768
    max_running_requests: int = 32
    chunked_prefill_size: int = 1024
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_dflash_block_size: int | None = None
    disable_overlap_schedule: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    random_seed: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in ("DFLASH", "NONE"):
                raise ValueError(f"speculative_algorithm must be DFLASH or NONE, got {self.speculative_algorithm!r}")
            self.speculative_algorithm = None if algo == "NONE" else algo
        a, b = self.speculative_num_draft_tokens, self.speculative_dflash_block_size
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"speculative_num_draft_tokens ({a}) and speculative_dflash_block_size ({b}) disagree"
            )
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = b
        n = self.speculative_num_draft_tokens
        if n is not None and n < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {n}")
        if self.speculative_algorithm is None and (self.speculative_draft_model_path or n is not None):
            raise ValueError("speculative draft options need speculative_algorithm='DFLASH'")
        if self.device not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"device must be cpu, cuda or xpu, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """"auto": bfloat16 where it runs natively (GPUs, CPUs with avx512_bf16 or AMX), else float32."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if has_fast_bf16(self.device) else torch.float32

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
