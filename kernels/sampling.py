"""Lossless rejection-sampling verification of a DFlash block (REFERENCE.md section 3).

The final token is drawn by inverse CDF over fixed-point weights (floor(prob * 2^32) as int64) with
an integer threshold (floor(u * 2^24) * total / 2^24), so the result does not depend on summation
order and every backend returns identical tokens for identical uniforms. Rows must be normalised.
"""

import torch
from sglang_dflash.kernels.backend import use_triton
from sglang_dflash.kernels.greedy import emit_tokens, leading_run

PROB_SCALE = 2.0**32
UNIFORM_BITS = 24


def inverse_cdf(weights: torch.Tensor, fallback: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds u * total; rows of zero weight use `fallback`."""
    w = (weights * PROB_SCALE).long()
    w_fallback = (fallback * PROB_SCALE).long()
    w = torch.where((w.sum(dim=1) == 0)[:, None], w_fallback, w)
    threshold = (uniforms * float(1 << UNIFORM_BITS)).long() * w.sum(dim=1)
    cdf = w.cumsum(dim=1) << UNIFORM_BITS
    return (cdf <= threshold[:, None]).sum(dim=1).clamp_max(w.shape[1] - 1)


def sampling_accept_torch(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    draft_probs: torch.Tensor | None,
    block_lens: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_probs/draft_probs [bs, B, V] (draft None = point masses) -> (accept_lens, next_bonus, out)."""
    bs, block, vocab = target_probs.shape
    drafts = candidates[:, 1:, None].long()
    p_draft = target_probs[:, :-1].gather(2, drafts).squeeze(2)
    if draft_probs is None:
        accepted = uniforms[:, :-1] < p_draft
    else:
        accepted = uniforms[:, :-1] * draft_probs[:, :-1].gather(2, drafts).squeeze(2) < p_draft
    accept_lens = leading_run(accepted, block_lens)
    rejected = (accept_lens < block_lens.long() - 1)[:, None]
    rows = torch.arange(bs, device=target_probs.device)
    p = target_probs[rows, accept_lens]
    if draft_probs is None:
        rejected_token = candidates.gather(1, (accept_lens[:, None] + 1).clamp_max(block - 1))
        vocab_ids = torch.arange(vocab, device=p.device)
        residual = torch.where(rejected & (vocab_ids == rejected_token), 0.0, p)
    else:
        residual = torch.where(rejected, (p - draft_probs[rows, accept_lens]).clamp_min(0.0), p)
    next_bonus = inverse_cdf(residual, p, residual_uniforms)
    return accept_lens, next_bonus, emit_tokens(candidates, accept_lens, next_bonus)


def sampling_accept(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    draft_probs: torch.Tensor | None,
    block_lens: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (target_probs, candidates, draft_probs, block_lens, uniforms, residual_uniforms)
    if use_triton(target_probs):
        from sglang_dflash.kernels.sampling_triton import sampling_accept_triton

        return sampling_accept_triton(*args)
    return sampling_accept_torch(*args)
