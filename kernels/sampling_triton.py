"""Triton version of `sampling_accept`: one program per request, two passes over the vocabulary."""

import triton
import triton.language as tl

from sglang_dflash.kernels.backend import PROB_SCALE, UNIFORM_BITS, strides
from sglang_dflash.kernels.greedy_triton import empty_accept_result, store_accept_result


@triton.jit
def _fixed_point(p_row, p_stride, ids, vocab, PROB_SCALE: tl.constexpr):
    """floor(p * 2^32) as int64 for the vocabulary ids `ids` (0 outside the vocabulary)."""
    return (tl.load(p_row + ids * p_stride, mask=ids < vocab, other=0.0) * PROB_SCALE).to(tl.int64)


@triton.jit
def _sampling_accept_kernel(
    p_ptr, cand_ptr, block_lens_ptr, u_ptr, bonus_u_ptr, accept_ptr, bonus_ptr, out_ptr,
    p_stride_b, p_stride_t, p_stride_v, cand_stride_b, cand_stride_t, lens_stride, u_stride_b, u_stride_t,
    bonus_u_stride, block, vocab,
    PROB_SCALE: tl.constexpr, UNIFORM_BITS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B).to(tl.int64)
    num_drafts = tl.load(block_lens_ptr + req * lens_stride).to(tl.int64) - 1
    valid = cols < num_drafts
    cand_row = cand_ptr + req * cand_stride_b
    drafts = tl.load(cand_row + (cols + 1) * cand_stride_t, mask=valid, other=0).to(tl.int64)
    p_draft = tl.load(p_ptr + req * p_stride_b + cols * p_stride_t + drafts * p_stride_v, mask=valid, other=0.0)
    u = tl.load(u_ptr + req * u_stride_b + cols * u_stride_t, mask=valid, other=1.0)
    acc = tl.min(tl.where(valid & ~(u < p_draft), cols, num_drafts), axis=0)
    rejected = acc < num_drafts
    rejected_token = tl.load(cand_row + (acc + 1) * cand_stride_t, mask=rejected, other=-1).to(tl.int64)

    # The residual is p without the rejected token; where that leaves nothing, p itself.
    p_row = p_ptr + req * p_stride_b + acc * p_stride_t
    p_sum = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        p_sum += _fixed_point(p_row, p_stride_v, start + tl.arange(0, BLOCK_V), vocab, PROB_SCALE)
    p_total = tl.sum(p_sum, axis=0)
    w_rejected = (tl.load(p_row + rejected_token * p_stride_v, mask=rejected, other=0.0) * PROB_SCALE).to(tl.int64)
    use_p = p_total == w_rejected
    skip = tl.where(use_p, -1, rejected_token)
    total = tl.where(use_p, p_total, p_total - w_rejected)
    threshold = (tl.load(bonus_u_ptr + req * bonus_u_stride) * (1 << UNIFORM_BITS)).to(tl.int64) * total

    seen = tl.zeros([BLOCK_V], dtype=tl.int64)
    below = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V)
        w = tl.where(ids == skip, 0, _fixed_point(p_row, p_stride_v, ids, vocab, PROB_SCALE))
        cdf = (tl.cumsum(w, axis=0) + tl.sum(seen, axis=0)) << UNIFORM_BITS
        below += (cdf <= threshold).to(tl.int64)
        seen += w
    bonus = tl.minimum(tl.sum(below, axis=0), vocab - 1)
    store_accept_result(
        cand_row, cand_stride_t, out_ptr + req * block, accept_ptr + req, bonus_ptr + req, acc, bonus, block, BLOCK_B
    )


def sampling_accept_triton(target_probs, candidates, block_lens, uniforms, bonus_uniforms):
    bs, block, vocab = target_probs.shape
    result = empty_accept_result(bs, block, target_probs.device)
    if bs:
        inputs = (target_probs, candidates, block_lens, uniforms, bonus_uniforms)
        _sampling_accept_kernel[(bs,)](
            *inputs, *result, *strides(*inputs), block, vocab, PROB_SCALE=PROB_SCALE, UNIFORM_BITS=UNIFORM_BITS,
            BLOCK_B=triton.next_power_of_2(block), BLOCK_V=min(4096, triton.next_power_of_2(vocab)), num_warps=8,
        )
    return result
