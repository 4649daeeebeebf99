"""ServerArgs: every engine and server option, with SGLang's names and checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sglang_dflash.device import has_fast_bf16
from sglang_dflash.speculative.drafter import merge_block_flags

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None  # KV cache slots; None: CPU_KV_TOKENS on cpu, else mem_fraction_static
    mem_fraction_static: float | None = None  # share of device memory for weights + KV pools (cuda/xpu: 0.85)
    max_running_requests: int = 32
    chunked_prefill_size: int = 1024
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_dflash_block_size: int | None = None
    speculative_adaptive: bool = True
    speculative_lookup: bool = True
    speculative_lookup_min_match: int = 2
    speculative_lookup_max_match: int = 4
    disable_overlap_schedule: bool | None = None  # None: per device, the faster loop (plain on CPU)
    enable_mixed_chunk: bool = False  # prefill chunks carry the running requests' decode rows (plain loop)
    enable_deterministic_inference: bool = False  # bf16 CPU linears batch-invariant (models/packed_linear.py)
    disable_radix_cache: bool = False  # no prefix cache: every request prefills its whole prompt
    enable_cache_report: bool = False  # server: usage.prompt_tokens_details.cached_tokens in OpenAI responses
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    random_seed: int | None = None
    max_queued_requests: int = 256  # beyond max_running_requests; more get a 503 with Retry-After
    max_request_body_mb: float = 8.0
    shutdown_grace_s: float = 10.0  # on SIGTERM, running requests get this long to finish
    request_timeout_s: float | None = None  # server: a request unfinished this long after arrival gets a 504

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in ("DFLASH", "NONE"):
                raise ValueError(f"speculative_algorithm must be DFLASH or NONE, got {self.speculative_algorithm!r}")
            self.speculative_algorithm = None if algo == "NONE" else algo
        self.speculative_num_draft_tokens = merge_block_flags(
            self.speculative_num_draft_tokens, self.speculative_dflash_block_size
        )
        n = self.speculative_num_draft_tokens
        if not 1 <= self.speculative_lookup_min_match <= self.speculative_lookup_max_match:
            raise ValueError("speculative_lookup_min_match must be >= 1 and <= speculative_lookup_max_match")
        if self.disable_overlap_schedule is None:
            # measured on CPU: the overlap loop's second thread team halves decode throughput on 2 cores
            self.disable_overlap_schedule = self.device == "cpu"
        if self.speculative_algorithm is None and (self.speculative_draft_model_path or n is not None):
            raise ValueError("speculative draft options need speculative_algorithm='DFLASH'")
        if self.device not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"device must be cpu, cuda or xpu, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 < self.max_request_body_mb <= 1024:
            raise ValueError(f"max_request_body_mb must be in (0, 1024], got {self.max_request_body_mb}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ValueError(f"shutdown_grace_s must be in [0, 3600], got {self.shutdown_grace_s}")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s <= 86400:
            raise ValueError(f"request_timeout_s must be in (0, 86400], got {self.request_timeout_s}")

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
