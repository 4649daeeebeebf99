"""Triton version of `greedy_accept` (one program per request) and what both accept kernels share."""

import torch
import triton
import triton.language as tl

from sglang_dflash.kernels.backend import strides


@triton.jit
def store_accept_result(
    cand_row, cand_stride, out_row, accept_ptr, bonus_ptr, acc, bonus, block, BLOCK_B: tl.constexpr
):
    """Write accept_len, next_bonus and the [B] row d1..d_acc, bonus, -1..."""
    cols = tl.arange(0, BLOCK_B)
    drafts = tl.load(cand_row + (cols + 1) * cand_stride, mask=cols < acc, other=-1).to(tl.int64)
    tl.store(out_row + cols, tl.where(cols == acc, bonus, drafts), mask=cols < block)
    tl.store(accept_ptr, acc)
    tl.store(bonus_ptr, bonus)


def empty_accept_result(bs: int, block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Contiguous int64 (accept_lens [bs], next_bonus [bs], out_tokens [bs, B]) for a kernel to fill."""
    return tuple(torch.empty(shape, dtype=torch.int64, device=device) for shape in (bs, bs, (bs, block)))


@triton.jit
def _greedy_accept_kernel(
    cand_ptr, target_ptr, block_lens_ptr, accept_ptr, bonus_ptr, out_ptr,
    cand_stride_b, cand_stride_t, target_stride_b, target_stride_t, lens_stride, block, BLOCK_B: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B)
    num_drafts = tl.load(block_lens_ptr + req * lens_stride).to(tl.int64) - 1
    valid = cols < num_drafts
    cand_row = cand_ptr + req * cand_stride_b
    target_row = target_ptr + req * target_stride_b
    drafts = tl.load(cand_row + (cols + 1) * cand_stride_t, mask=valid, other=0)
    preds = tl.load(target_row + cols * target_stride_t, mask=valid, other=0)
    acc = tl.min(tl.where(valid & (drafts != preds), cols, num_drafts), axis=0)
    bonus = tl.load(target_row + acc * target_stride_t).to(tl.int64)
    store_accept_result(
        cand_row, cand_stride_t, out_ptr + req * block, accept_ptr + req, bonus_ptr + req, acc, bonus, block, BLOCK_B
    )


def greedy_accept_triton(candidates, target_argmax, block_lens):
    bs, block = candidates.shape
    result = empty_accept_result(bs, block, candidates.device)
    if bs:
        inputs = (candidates, target_argmax, block_lens)
        _greedy_accept_kernel[(bs,)](*inputs, *result, *strides(*inputs), block, BLOCK_B=triton.next_power_of_2(block),
                                     num_warps=1)
    return result
