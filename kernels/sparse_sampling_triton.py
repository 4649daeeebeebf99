"""Triton version of `sparse_sampling_accept`: one program per request, two passes over the vocabulary."""

import triton
import triton.language as tl

from sglang_dflash.kernels.backend import PROB_SCALE, UNIFORM_BITS, strides
from sglang_dflash.kernels.greedy_triton import empty_accept_result, store_accept_result


@triton.jit
def _residual_chunk(p_row, p_stride, ids, vocab, cand_ids, cand_q, rejected, PROB_SCALE: tl.constexpr):
    """(fixed-point p, fixed-point residual max(p - q, 0) where rejected, else p) for the vocabulary ids `ids`."""
    p = tl.load(p_row + ids * p_stride, mask=ids < vocab, other=0.0)
    q = tl.sum(tl.where(ids[:, None] == cand_ids[None, :], cand_q[None, :], 0.0), axis=1)
    residual = tl.where(rejected, tl.maximum(p - q, 0.0), p)
    return (p * PROB_SCALE).to(tl.int64), (residual * PROB_SCALE).to(tl.int64)


@triton.jit
def _sparse_sampling_accept_kernel(
    p_ptr, cand_ptr, block_lens_ptr, ids_ptr, q_ptr, u_ptr, bonus_u_ptr, accept_ptr, bonus_ptr, out_ptr,
    p_stride_b, p_stride_t, p_stride_v, cand_stride_b, cand_stride_t, lens_stride,
    ids_stride_b, ids_stride_t, ids_stride_k, q_stride_b, q_stride_t, q_stride_k, u_stride_b, u_stride_t,
    bonus_u_stride, block, vocab, top_k,
    PROB_SCALE: tl.constexpr, UNIFORM_BITS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_B).to(tl.int64)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    num_drafts = tl.load(block_lens_ptr + req * lens_stride).to(tl.int64) - 1
    valid = cols < num_drafts
    cand_row = cand_ptr + req * cand_stride_b
    drafts = tl.load(cand_row + (cols + 1) * cand_stride_t, mask=valid, other=0).to(tl.int64)
    p_draft = tl.load(p_ptr + req * p_stride_b + cols * p_stride_t + drafts * p_stride_v, mask=valid, other=0.0)
    valid_k = valid[:, None] & (ks[None, :] < top_k)
    ids = tl.load(ids_ptr + req * ids_stride_b + cols[:, None] * ids_stride_t + ks[None, :] * ids_stride_k,
                  mask=valid_k, other=-1)
    q = tl.load(q_ptr + req * q_stride_b + cols[:, None] * q_stride_t + ks[None, :] * q_stride_k,
                mask=valid_k, other=0.0)
    q_draft = tl.sum(tl.where(ids == drafts[:, None], q, 0.0), axis=1)
    u = tl.load(u_ptr + req * u_stride_b + cols * u_stride_t, mask=valid, other=1.0)
    acc = tl.min(tl.where(valid & ~(u * q_draft < p_draft), cols, num_drafts), axis=0)
    rejected = acc < num_drafts

    # The residual max(p - q, 0) of row acc over its candidates; where that leaves nothing, p itself.
    p_row = p_ptr + req * p_stride_b + acc * p_stride_t
    row_k = ks < tl.where(rejected, top_k, 0)  # no candidates when nothing was rejected
    cand_ids = tl.load(ids_ptr + req * ids_stride_b + acc * ids_stride_t + ks * ids_stride_k, mask=row_k, other=-1)
    cand_q = tl.load(q_ptr + req * q_stride_b + acc * q_stride_t + ks * q_stride_k, mask=row_k, other=0.0)
    p_sum = tl.zeros([BLOCK_V], dtype=tl.int64)
    r_sum = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        w_p, w_r = _residual_chunk(p_row, p_stride_v, start + tl.arange(0, BLOCK_V), vocab, cand_ids, cand_q,
                                   rejected, PROB_SCALE)
        p_sum += w_p
        r_sum += w_r
    r_total = tl.sum(r_sum, axis=0)
    use_p = r_total == 0
    total = tl.where(use_p, tl.sum(p_sum, axis=0), r_total)
    threshold = (tl.load(bonus_u_ptr + req * bonus_u_stride) * (1 << UNIFORM_BITS)).to(tl.int64) * total

    seen = tl.zeros([BLOCK_V], dtype=tl.int64)
    below = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        w_p, w_r = _residual_chunk(p_row, p_stride_v, start + tl.arange(0, BLOCK_V), vocab, cand_ids, cand_q,
                                   rejected, PROB_SCALE)
        w = tl.where(use_p, w_p, w_r)
        cdf = (tl.cumsum(w, axis=0) + tl.sum(seen, axis=0)) << UNIFORM_BITS
        below += (cdf <= threshold).to(tl.int64)
        seen += w
    bonus = tl.minimum(tl.sum(below, axis=0), vocab - 1)
    store_accept_result(
        cand_row, cand_stride_t, out_ptr + req * block, accept_ptr + req, bonus_ptr + req, acc, bonus, block, BLOCK_B
    )


def sparse_sampling_accept_triton(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms,
                                  bonus_uniforms):
    bs, block, vocab = target_probs.shape
    top_k = draft_ids.shape[2]
    result = empty_accept_result(bs, block, target_probs.device)
    if bs:
        inputs = (target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms, bonus_uniforms)
        block_k = triton.next_power_of_2(top_k)
        _sparse_sampling_accept_kernel[(bs,)](
            *inputs, *result, *strides(*inputs), block, vocab, top_k, PROB_SCALE=PROB_SCALE,
            UNIFORM_BITS=UNIFORM_BITS, BLOCK_B=triton.next_power_of_2(block), BLOCK_K=block_k,
            BLOCK_V=min(triton.next_power_of_2(vocab), max(16, 16384 // block_k)), num_warps=8,
        )
    return result
