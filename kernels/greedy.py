"""Greedy verification of a DFlash block: longest draft prefix matching the target argmax, then a bonus."""

import torch

from sglang_dflash.kernels.backend import use_triton


def emit_tokens(candidates: torch.Tensor, accept_lens: torch.Tensor, next_bonus: torch.Tensor) -> torch.Tensor:
    """[bs, B] int64: d1..d_acc, then the new bonus, then -1."""
    bs, block = candidates.shape
    cols = torch.arange(block, device=candidates.device)
    drafts = torch.cat([candidates[:, 1:], candidates.new_full((bs, 1), -1)], dim=1).long()
    acc = accept_lens[:, None]
    out = torch.where(cols < acc, drafts, -1)
    return torch.where(cols == acc, next_bonus[:, None].long(), out)


def leading_run(hits: torch.Tensor, block_lens: torch.Tensor) -> torch.Tensor:
    """Length of the leading all-True run of `hits` [bs, B-1], capped at block_lens - 1."""
    cols = torch.arange(hits.shape[1], device=hits.device)
    hits = hits & (cols < block_lens[:, None].long() - 1)
    return hits.long().cumprod(dim=1).sum(dim=1)


def check_block(candidates: torch.Tensor, block_lens: torch.Tensor, *per_token: torch.Tensor) -> None:
    """candidates [bs, B], block_lens [bs] and each of `per_token` [bs, B, ...]."""
    bs, block = candidates.shape
    assert block_lens.shape == (bs,), (block_lens.shape, bs)
    for t in per_token:
        assert t.shape[:2] == (bs, block), (t.shape, candidates.shape)


def greedy_accept_torch(candidates, target_argmax, block_lens):
    """Torch reference of `greedy_accept`."""
    accept_lens = leading_run(candidates[:, 1:] == target_argmax[:, :-1], block_lens)
    next_bonus = target_argmax.gather(1, accept_lens[:, None]).squeeze(1).long()
    return accept_lens, next_bonus, emit_tokens(candidates, accept_lens, next_bonus)


def greedy_accept(
    candidates: torch.Tensor, target_argmax: torch.Tensor, block_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates [bs, B] = [bonus, d1..d_{B-1}], target_argmax [bs, B], block_lens [bs] (request i verifies
    its first block_lens[i] - 1 drafts) -> int64 (accept_lens [bs], next_bonus [bs], out_tokens [bs, B]);
    out_tokens rows are d1..d_acc, the next bonus, then -1. Any strides."""
    check_block(candidates, block_lens, target_argmax)
    if use_triton(candidates):
        from sglang_dflash.kernels.greedy_triton import greedy_accept_triton as impl
    else:
        impl = greedy_accept_torch
    return impl(candidates, target_argmax, block_lens)
