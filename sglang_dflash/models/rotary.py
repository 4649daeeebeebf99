"""Rotary position embedding (rotate-half / neox style), the one implementation for the target and the draft.

(The fused draft-KV kernel in `kernels/` reads `build_cos_sin_cache`'s table and rotates by itself.)"""

from __future__ import annotations

import torch


def build_cos_sin_cache(head_dim: int, max_positions: int, theta: float, device: torch.device) -> torch.Tensor:
    """float32 [max_positions, head_dim] = cat(cos, sin), each head_dim // 2 wide."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)


def rope_table(cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[max_positions, 2, head_dim] = (cat(cos, cos), cat(-sin, sin)) in `dtype`, the dtype RoPE computes in."""
    cos, sin = cos_sin_cache.chunk(2, -1)
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1).to(dtype)


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [T, 1, head_dim], of `rope_table` rows at `positions` [T]."""
    cos, sin = table.index_select(0, positions).unsqueeze(2).unbind(1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by `rope_at`'s (cos, sin); computed in their dtype, returned in x's."""
    xc = x.to(cos.dtype)
    return torch.addcmul(xc * cos, xc.roll(x.shape[-1] // 2, -1), sin).to(x.dtype)
