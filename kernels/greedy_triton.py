"""Triton version of `greedy_accept` (one program per request) and the shared result writer."""

import torch
import triton
import triton.language as tl


@triton.jit
def store_accept_result(cand_row, out_row, accept_ptr, bonus_ptr, acc, bonus, block, BLOCK_B: tl.constexpr):
    """Write accept_len, next_bonus and the [B] row d1..d_acc, bonus, -1..."""
    cols = tl.arange(0, BLOCK_B)
    drafts = tl.load(cand_row + cols + 1, mask=cols < acc, other=-1).to(tl.int64)
    out = tl.where(cols == acc, bonus, drafts)
    tl.store(out_row + cols, out, mask=cols < block)
    tl.store(accept_ptr, acc)
    tl.store(bonus_ptr, bonus)


@triton.jit
def _greedy_accept_kernel(
    cand_ptr,
    target_ptr,
    block_lens_ptr,
    accept_ptr,
    bonus_ptr,
    out_ptr,
    cand_stride,
    target_stride,
    out_stride,
    block,
    BLOCK_B: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B)
    num_drafts = tl.load(block_lens_ptr + req).to(tl.int64) - 1
    valid = cols < num_drafts
    cand_row = cand_ptr + req * cand_stride
    target_row = target_ptr + req * target_stride
    drafts = tl.load(cand_row + cols + 1, mask=valid, other=0)
    preds = tl.load(target_row + cols, mask=valid, other=0)
    acc = tl.min(tl.where(valid & (drafts != preds), cols, num_drafts), axis=0)
    bonus = tl.load(target_row + acc).to(tl.int64)
    store_accept_result(
        cand_row, out_ptr + req * out_stride, accept_ptr + req, bonus_ptr + req, acc, bonus, block, BLOCK_B
    )


def greedy_accept_triton(
    candidates: torch.Tensor, target_argmax: torch.Tensor, block_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, block = candidates.shape
    device = candidates.device
    accept_lens = torch.empty(bs, dtype=torch.int64, device=device)
    next_bonus = torch.empty(bs, dtype=torch.int64, device=device)
    out_tokens = torch.empty((bs, block), dtype=torch.int64, device=device)
    if bs == 0:
        return accept_lens, next_bonus, out_tokens
    assert candidates.stride(1) == 1 and target_argmax.stride(1) == 1
    _greedy_accept_kernel[(bs,)](
        candidates,
        target_argmax,
        block_lens,
        accept_lens,
        next_bonus,
        out_tokens,
        candidates.stride(0),
        target_argmax.stride(0),
        out_tokens.stride(0),
        block,
        BLOCK_B=triton.next_power_of_2(block),
        num_warps=1,
    )
    return accept_lens, next_bonus, out_tokens
