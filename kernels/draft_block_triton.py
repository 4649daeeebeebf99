"""Triton version of `prepare_draft_block`: one program per request."""

import torch
import triton
import triton.language as tl


@triton.jit
def _prepare_draft_block_kernel(
    bonus_ptr,
    seq_lens_ptr,
    req_pool_ptr,
    req_to_token_ptr,
    ids_ptr,
    positions_ptr,
    loc_ptr,
    table_stride,
    block_size,
    mask_token_id,
    BLOCK_B: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_B)
    in_block = offsets < block_size
    positions = tl.load(seq_lens_ptr + req).to(tl.int64) + offsets
    table_row = req_to_token_ptr + tl.load(req_pool_ptr + req).to(tl.int64) * table_stride
    loc = tl.load(table_row + positions, mask=in_block).to(tl.int64)
    bonus = tl.load(bonus_ptr + req).to(tl.int64)
    ids = tl.where(offsets == 0, bonus, tl.full([BLOCK_B], mask_token_id, tl.int64))
    dst = req * block_size + offsets
    tl.store(ids_ptr + dst, ids, mask=in_block)
    tl.store(positions_ptr + dst, positions, mask=in_block)
    tl.store(loc_ptr + dst, loc, mask=in_block)


def prepare_draft_block_triton(
    bonus: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs = seq_lens.shape[0]
    outputs = tuple(torch.empty(bs * block_size, dtype=torch.int64, device=seq_lens.device) for _ in range(3))
    if bs == 0:
        return outputs
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    _prepare_draft_block_kernel[(bs,)](
        bonus,
        seq_lens,
        req_pool_indices,
        req_to_token,
        *outputs,
        req_to_token.stride(0),
        block_size,
        mask_token_id,
        BLOCK_B=triton.next_power_of_2(block_size),
        num_warps=1,
    )
    return outputs
