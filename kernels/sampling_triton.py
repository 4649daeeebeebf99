"""Triton version of `sampling_accept`: one program per request, two passes over the vocabulary."""

import torch
import triton
import triton.language as tl
from sglang_dflash.kernels.greedy_triton import store_accept_result
from sglang_dflash.kernels.sampling import PROB_SCALE, UNIFORM_BITS


@triton.jit
def _residual_weights(
    p_row,
    q_row,
    start,
    vocab,
    rejected,
    rejected_token,
    PROB_SCALE: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Fixed-point weights of the residual distribution and of p itself for one vocabulary chunk."""
    ids = start + tl.arange(0, BLOCK_V)
    in_vocab = ids < vocab
    p = tl.load(p_row + ids, mask=in_vocab, other=0.0)
    if HAS_Q:
        q = tl.load(q_row + ids, mask=in_vocab, other=0.0)
        residual = tl.where(rejected, tl.maximum(p - q, 0.0), p)
    else:
        residual = tl.where(rejected & (ids == rejected_token), 0.0, p)
    return (residual * PROB_SCALE).to(tl.int64), (p * PROB_SCALE).to(tl.int64)


@triton.jit
def _sampling_accept_kernel(
    p_ptr,
    cand_ptr,
    q_ptr,
    block_lens_ptr,
    u_ptr,
    residual_u_ptr,
    accept_ptr,
    bonus_ptr,
    out_ptr,
    p_stride_b,
    p_stride_t,
    q_stride_b,
    q_stride_t,
    cand_stride,
    u_stride,
    out_stride,
    block,
    vocab,
    PROB_SCALE: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B).to(tl.int64)
    num_drafts = tl.load(block_lens_ptr + req).to(tl.int64) - 1
    valid = cols < num_drafts
    cand_row = cand_ptr + req * cand_stride
    drafts = tl.load(cand_row + cols + 1, mask=valid, other=0).to(tl.int64)
    p_draft = tl.load(p_ptr + req * p_stride_b + cols * p_stride_t + drafts, mask=valid, other=0.0)
    u = tl.load(u_ptr + req * u_stride + cols, mask=valid, other=1.0)
    if HAS_Q:
        q_draft = tl.load(q_ptr + req * q_stride_b + cols * q_stride_t + drafts, mask=valid, other=1.0)
        accepted = u * q_draft < p_draft
    else:
        accepted = u < p_draft
    acc = tl.min(tl.where(valid & ~accepted, cols, num_drafts), axis=0)
    rejected = acc < num_drafts
    rejected_token = tl.load(cand_row + acc + 1, mask=rejected, other=-1).to(tl.int64)

    p_row = p_ptr + req * p_stride_b + acc * p_stride_t
    q_row = q_ptr + req * q_stride_b + acc * q_stride_t
    residual_sum = tl.zeros([BLOCK_V], dtype=tl.int64)
    p_sum = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        w, w_p = _residual_weights(
            p_row, q_row, start, vocab, rejected, rejected_token, PROB_SCALE, HAS_Q, BLOCK_V
        )
        residual_sum += w
        p_sum += w_p
    use_p = tl.sum(residual_sum, axis=0) == 0
    total = tl.where(use_p, tl.sum(p_sum, axis=0), tl.sum(residual_sum, axis=0))
    u_fixed = (tl.load(residual_u_ptr + req) * (1 << UNIFORM_BITS)).to(tl.int64)
    threshold = u_fixed * total

    seen = tl.zeros([BLOCK_V], dtype=tl.int64)
    below = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        w, w_p = _residual_weights(
            p_row, q_row, start, vocab, rejected, rejected_token, PROB_SCALE, HAS_Q, BLOCK_V
        )
        w = tl.where(use_p, w_p, w)
        cdf = (tl.cumsum(w, axis=0) + tl.sum(seen, axis=0)) << UNIFORM_BITS
        below += (cdf <= threshold).to(tl.int64)
        seen += w
    bonus = tl.minimum(tl.sum(below, axis=0), vocab - 1)
    store_accept_result(
        cand_row, out_ptr + req * out_stride, accept_ptr + req, bonus_ptr + req, acc, bonus, block, BLOCK_B
    )


def sampling_accept_triton(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    draft_probs: torch.Tensor | None,
    block_lens: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, block, vocab = target_probs.shape
    device = target_probs.device
    accept_lens = torch.empty(bs, dtype=torch.int64, device=device)
    next_bonus = torch.empty(bs, dtype=torch.int64, device=device)
    out_tokens = torch.empty((bs, block), dtype=torch.int64, device=device)
    if bs == 0:
        return accept_lens, next_bonus, out_tokens
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs
    for t in (target_probs, q, candidates, uniforms):
        assert t.stride(-1) == 1, "innermost dim must be contiguous"
    _sampling_accept_kernel[(bs,)](
        target_probs,
        candidates,
        q,
        block_lens,
        uniforms,
        residual_uniforms,
        accept_lens,
        next_bonus,
        out_tokens,
        target_probs.stride(0),
        target_probs.stride(1),
        q.stride(0),
        q.stride(1),
        candidates.stride(0),
        uniforms.stride(0),
        out_tokens.stride(0),
        block,
        vocab,
        PROB_SCALE=PROB_SCALE,
        UNIFORM_BITS=UNIFORM_BITS,
        HAS_Q=has_q,
        BLOCK_B=triton.next_power_of_2(block),
        BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
        num_warps=8,
    )
    return accept_lens, next_bonus, out_tokens
