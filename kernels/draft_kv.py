"""Just-in-time draft context KV: per-layer K RMSNorm + neox RoPE, fused write into the draft KV pool: Triton on
CUDA/XPU, the C++ kernel `csrc/draft_kv.cpp` on CPU where it builds (kv and pool of one dtype), torch otherwise.
The same C++ kernel serves a draft block's own queries and K/V on CPU (`block_kv_kernel`)."""

from collections.abc import Callable

import torch

from sglang_dflash.kernels.backend import use_triton
from sglang_dflash.kernels.cpu_extensions import cpu_kernel


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-halves RoPE on the first `rotary_dim` dims of `x`; `cos`/`sin` broadcast to x[..., :rot/2]."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def materialize_draft_kv_torch(
    kv, k_norm_weight, positions, cos_sin_cache, rotary_dim, eps, k_buffer, v_buffer, out_cache_loc
) -> None:
    """Torch reference of `materialize_draft_kv`."""
    k = kv[:, :, 0].float()
    k = k * torch.rsqrt(k.pow(2).mean(dim=-1, keepdim=True) + eps) * k_norm_weight.float()[None, :, None]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    k = rope_neox(k, cos[:, None, None], sin[:, None, None], rotary_dim)
    loc = out_cache_loc.long()
    k_buffer[:, loc] = k.transpose(0, 1).to(k_buffer.dtype)
    v_buffer[:, loc] = kv[:, :, 1].transpose(0, 1).to(v_buffer.dtype)


def materialize_draft_kv(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    eps: float,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """kv [N, L, 2, nKV, hd] -> k_buffer/v_buffer [L, slots, nKV, hd] at out_cache_loc [N]: K is RMSNormed
    (k_norm_weight [L, hd]) and rotated at positions [N] (cos_sin_cache [max_pos, rotary_dim] = [cos | sin]).
    Any strides; in place."""
    n, layers, two, heads, head_dim = kv.shape
    assert two == 2 and rotary_dim % 2 == 0 and rotary_dim <= head_dim, (kv.shape, rotary_dim)
    assert k_norm_weight.shape == (layers, head_dim) and cos_sin_cache.shape[1] == rotary_dim
    assert positions.shape == out_cache_loc.shape == (n,)
    assert k_buffer.shape == v_buffer.shape and k_buffer.shape[0] == layers and k_buffer.shape[2:] == (heads, head_dim)
    if use_triton(kv):
        from sglang_dflash.kernels.draft_kv_triton import materialize_draft_kv_triton as impl
    elif kv.device.type == "cpu" and kv.dtype == k_buffer.dtype == v_buffer.dtype \
            and (kernel := cpu_kernel("draft_kv")) is not None:
        impl = kernel.materialize_draft_kv
    else:
        impl = materialize_draft_kv_torch
    impl(kv, k_norm_weight, positions, cos_sin_cache, rotary_dim, eps, k_buffer, v_buffer, out_cache_loc)


def block_kv_kernel(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> Callable | None:
    """The C++ `norm_rope_set_kv(q, k, v, q_norm_weight, k_norm_weight, positions, cos_sin_cache, rotary_dim, eps,
    k_cache, v_cache, loc) -> q` of a draft layer's block (queries and keys RMSNormed and rotated in float32, keys and
    values written into rows loc of the layer's pool), on CPU where it builds and x and the pool share a dtype; else
    None (`DraftAttention.project_qkv` and index_copy_). dtype: the block states'; cache_dtype: the pool's."""
    if device.type == "cpu" and dtype == cache_dtype and (kernel := cpu_kernel("draft_kv")) is not None:
        return kernel.norm_rope_set_kv
    return None
