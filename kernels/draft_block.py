"""Inputs of the next draft block: ids [bonus, MASK...], positions p..p+B-1 and their KV slots."""

import torch
from sglang_dflash.kernels.backend import use_triton


def prepare_draft_block_torch(
    bonus: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (input_ids, positions, out_cache_loc), each flat [bs * block_size] int64."""
    offsets = torch.arange(block_size, device=seq_lens.device)
    positions = seq_lens[:, None].long() + offsets
    out_cache_loc = req_to_token[req_pool_indices[:, None].long(), positions].long()
    input_ids = torch.where(offsets == 0, bonus[:, None].long(), mask_token_id)
    return input_ids.flatten(), positions.flatten(), out_cache_loc.flatten()


def prepare_draft_block(
    bonus: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (bonus, seq_lens, req_pool_indices, req_to_token, block_size, mask_token_id)
    if use_triton(seq_lens):
        from sglang_dflash.kernels.draft_block_triton import prepare_draft_block_triton

        return prepare_draft_block_triton(*args)
    return prepare_draft_block_torch(*args)
