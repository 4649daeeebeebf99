"""Rotary position embedding (neox / rotate-half style), with partial rotary support."""

from __future__ import annotations

import torch


def build_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float, device: torch.device) -> torch.Tensor:
    """Returns float32 [max_positions, rotary_dim] = cat(cos, sin), each rotary_dim // 2 wide."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos_sin [T, rotary_dim] gathered at each token's position."""
    rot = cos_sin.shape[-1]
    half = rot // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    xf = x[..., :rot].float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot:]], dim=-1)
