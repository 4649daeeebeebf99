"""Lossless rejection-sampling verification of a block whose drafts were sampled from sparse distributions q
over K candidates per position (DFlash 2's selector; a point mass is one candidate with q = 1).

Draft d_i is accepted when u_i * q_i(d_i) < p_i(d_i) (i.e. with probability min(1, p/q)); after the first
rejection the bonus is drawn from the residual max(p - q, 0) (p itself where that leaves nothing), by the
fixed-point inverse CDF of `sampling_accept`, so every backend returns identical tokens for identical
uniforms. Rows of p must be normalised; the candidates of a row with q > 0 must be distinct.
"""

import torch

from sglang_dflash.kernels.backend import use_triton
from sglang_dflash.kernels.greedy import check_block, emit_tokens, leading_run
from sglang_dflash.kernels.sampling import inverse_cdf


def sparse_sampling_accept_torch(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms,
                                 bonus_uniforms):
    """Torch reference of `sparse_sampling_accept`."""
    bs, block, vocab = target_probs.shape
    drafts = candidates[:, 1:].long()
    p_draft = target_probs[:, :-1].gather(2, drafts[..., None]).squeeze(2)
    q_draft = torch.where(draft_ids[:, :-1] == drafts[..., None], draft_probs[:, :-1], 0.0).sum(-1)
    accept_lens = leading_run(uniforms[:, :-1] * q_draft < p_draft, block_lens)
    rejected = (accept_lens < block_lens.long() - 1)[:, None]
    rows = torch.arange(bs, device=target_probs.device)
    p = target_probs[rows, accept_lens]
    q = torch.zeros_like(p).scatter_add_(1, draft_ids[rows, accept_lens].long(), draft_probs[rows, accept_lens])
    residual = torch.where(rejected, (p - q).clamp_min(0.0), p)
    next_bonus = inverse_cdf(residual, p, bonus_uniforms)
    return accept_lens, next_bonus, emit_tokens(candidates, accept_lens, next_bonus)


def sparse_sampling_accept(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    block_lens: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_probs [bs, B, V] float32, candidates [bs, B] = [bonus, d1..d_{B-1}], block_lens [bs], draft_ids
    [bs, B, K] and draft_probs [bs, B, K] float32 (row i: the candidates d_{i+1} was drawn from and their q; the
    last row is unused), uniforms [bs, B] (column i tests d_{i+1}; the last is unused), bonus_uniforms [bs] ->
    int64 (accept_lens [bs], next_bonus [bs], out_tokens [bs, B]) as `greedy_accept`. Any strides."""
    check_block(candidates, block_lens, target_probs, draft_ids, draft_probs, uniforms)
    assert draft_ids.shape == draft_probs.shape, (draft_ids.shape, draft_probs.shape)
    assert target_probs.dtype == draft_probs.dtype == torch.float32, (target_probs.dtype, draft_probs.dtype)
    assert bonus_uniforms.shape == block_lens.shape, (bonus_uniforms.shape, block_lens.shape)
    if use_triton(target_probs):
        from sglang_dflash.kernels.sparse_sampling_triton import sparse_sampling_accept_triton as impl
    else:
        impl = sparse_sampling_accept_torch
    return impl(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms, bonus_uniforms)
