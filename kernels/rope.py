"""Rotary embedding of a layer's queries and keys, with its keys and values written into the paged KV pool: the C++
kernel `csrc/rope.cpp` for bf16 on CPU where it builds (one pass instead of roll, two multiplies, addcmul and two
index_copy_: ~20 us a layer at 1 token); `models/rotary.py: apply_rope` and index_copy_ otherwise. Both round as
apply_rope does."""

import torch

from sglang_dflash.kernels.cpu_extensions import cpu_kernel
from sglang_dflash.models.rotary import apply_rope


def rope_set_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """qk [T, H, hd]: the queries, then one key per KV head; v [T, KV, hd]; (cos, sin) from `rope_at`; k_cache and
    v_cache [S, KV, hd] (one layer of the pool); loc [T] slots. Returns the rotated queries [T, H - KV, hd] and writes
    the rotated keys and the values into rows loc of the caches."""
    nq = qk.shape[1] - v.shape[1]
    if qk.device.type == "cpu" and k_cache.dtype == qk.dtype == v.dtype == cos.dtype == torch.bfloat16 \
            and (kernel := cpu_kernel("rope")) is not None:
        return kernel.rope_set_kv(qk, v, cos, sin, k_cache, v_cache, loc)
    qk = apply_rope(qk, cos, sin)
    k_cache.index_copy_(0, loc, qk[:, nq:].to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))
    return qk[:, :nq]
