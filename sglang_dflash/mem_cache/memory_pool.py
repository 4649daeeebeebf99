"""Paged KV memory, SGLang style: req_to_token_pool (request row -> token slots) and
token_to_kv_pool (per-layer K/V buffers indexed by token slot) with a free-list allocator."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A [size, max_context_len] table of token slots, one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, idx: int) -> None:
        self.free_slots.append(idx)


class TokenToKVPoolAllocator:
    """Free list of token slots. Slot 0 is reserved as a padding target and never handed out."""

    def __init__(self, size: int, device: torch.device):
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots on the pool's device, or None when not enough are free (never raises)."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out.to(self.device)

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        self._free[self._num_free : self._num_free + n] = slots.to("cpu", torch.int64)
        self._num_free += n


class MHATokenToKVPool:
    """K and V buffers for all layers, [num_layers, size + 1, num_kv_heads, head_dim] each."""

    def __init__(
        self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device,
    ):
        self.size = size
        self.dtype = dtype
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
