"""Lossless rejection-sampling verification of a DFlash block whose drafts are point masses (q one-hot).

Draft d_i is accepted when u_i < p_i(d_i); after the first rejection the bonus is drawn from the residual
max(p - q, 0), p without the rejected token (p itself where that leaves nothing). It is drawn by inverse CDF
over fixed-point weights (floor(prob * 2^32) as int64) with an integer threshold (floor(u * 2^24) * total /
2^24), so every backend returns identical tokens for identical uniforms. Rows must be normalised.
"""

import torch

from sglang_dflash.kernels.backend import PROB_SCALE, UNIFORM_BITS, use_triton
from sglang_dflash.kernels.greedy import check_block, emit_tokens, leading_run


def inverse_cdf(weights: torch.Tensor, fallback: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative weight exceeds u * total; rows of zero weight use `fallback`."""
    w = (weights * PROB_SCALE).long()
    w_fallback = (fallback * PROB_SCALE).long()
    w = torch.where((w.sum(dim=1) == 0)[:, None], w_fallback, w)
    threshold = (uniforms * float(1 << UNIFORM_BITS)).long() * w.sum(dim=1)
    cdf = w.cumsum(dim=1) << UNIFORM_BITS
    return (cdf <= threshold[:, None]).sum(dim=1).clamp_max(w.shape[1] - 1)


def sampling_accept_torch(target_probs, candidates, block_lens, uniforms, bonus_uniforms):
    """Torch reference of `sampling_accept`."""
    bs, block, vocab = target_probs.shape
    p_draft = target_probs[:, :-1].gather(2, candidates[:, 1:, None].long()).squeeze(2)
    accept_lens = leading_run(uniforms[:, :-1] < p_draft, block_lens)
    rejected = (accept_lens < block_lens.long() - 1)[:, None]
    p = target_probs[torch.arange(bs, device=target_probs.device), accept_lens]
    rejected_token = candidates.gather(1, (accept_lens[:, None] + 1).clamp_max(block - 1))
    vocab_ids = torch.arange(vocab, device=p.device)
    residual = torch.where(rejected & (vocab_ids == rejected_token), 0.0, p)
    next_bonus = inverse_cdf(residual, p, bonus_uniforms)
    return accept_lens, next_bonus, emit_tokens(candidates, accept_lens, next_bonus)


def sampling_accept(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    block_lens: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target_probs [bs, B, V], candidates [bs, B] = [bonus, d1..d_{B-1}], block_lens [bs] (request i verifies
    its first block_lens[i] - 1 drafts), uniforms [bs, B] (column i tests d_{i+1}; the last is unused),
    bonus_uniforms [bs] -> int64 (accept_lens [bs], next_bonus [bs], out_tokens [bs, B]) as `greedy_accept`.
    Any strides."""
    check_block(candidates, block_lens, target_probs, uniforms)
    assert bonus_uniforms.shape == block_lens.shape, (bonus_uniforms.shape, block_lens.shape)
    if use_triton(target_probs):
        from sglang_dflash.kernels.sampling_triton import sampling_accept_triton as impl
    else:
        impl = sampling_accept_torch
    return impl(target_probs, candidates, block_lens, uniforms, bonus_uniforms)
