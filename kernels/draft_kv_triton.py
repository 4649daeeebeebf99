"""Triton version of `materialize_draft_kv`: one program per (token, layer), all KV heads at once."""

import triton
import triton.language as tl

from sglang_dflash.kernels.backend import strides


@triton.jit
def _materialize_draft_kv_kernel(
    kv_ptr, w_ptr, pos_ptr, cos_sin_ptr, k_buf_ptr, v_buf_ptr, loc_ptr,
    kv_stride_n, kv_stride_l, kv_stride_kv, kv_stride_h, kv_stride_d, w_stride_l, w_stride_d, pos_stride,
    cs_stride_p, cs_stride_d, kb_stride_l, kb_stride_slot, kb_stride_h, kb_stride_d,
    vb_stride_l, vb_stride_slot, vb_stride_h, vb_stride_d, loc_stride,
    num_heads, head_dim, eps, HALF_ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    rotated = dims < 2 * HALF_ROT
    low = dims < HALF_ROT
    partner = tl.where(low, dims + HALF_ROT, dims - HALF_ROT)
    freq = tl.where(low, dims, dims - HALF_ROT)

    k_src = kv_ptr + token * kv_stride_n + layer * kv_stride_l + heads * kv_stride_h
    x = tl.load(k_src + dims * kv_stride_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(k_src + partner * kv_stride_d, mask=mask & rotated, other=0.0).to(tl.float32)
    w_row = w_ptr + layer * w_stride_l
    w = tl.load(w_row + dims * w_stride_d, mask=dims < head_dim, other=0.0).to(tl.float32)
    w_partner = tl.load(w_row + partner * w_stride_d, mask=rotated, other=0.0).to(tl.float32)

    scale = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]
    y = x * scale * w
    y_partner = x_partner * scale * w_partner
    cs_row = cos_sin_ptr + tl.load(pos_ptr + token * pos_stride).to(tl.int64) * cs_stride_p
    cos = tl.load(cs_row + freq * cs_stride_d, mask=rotated, other=1.0)
    sin = tl.load(cs_row + (HALF_ROT + freq) * cs_stride_d, mask=rotated, other=0.0)
    y_partner = tl.where(low, -y_partner, y_partner)
    out = tl.where(rotated, y * cos + y_partner * sin, y)

    slot = tl.load(loc_ptr + token * loc_stride).to(tl.int64)
    k_dst = k_buf_ptr + layer * kb_stride_l + slot * kb_stride_slot + heads * kb_stride_h + dims * kb_stride_d
    tl.store(k_dst, out.to(k_buf_ptr.dtype.element_ty), mask=mask)
    v = tl.load(k_src + kv_stride_kv + dims * kv_stride_d, mask=mask)
    v_dst = v_buf_ptr + layer * vb_stride_l + slot * vb_stride_slot + heads * vb_stride_h + dims * vb_stride_d
    tl.store(v_dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def materialize_draft_kv_triton(
    kv, k_norm_weight, positions, cos_sin_cache, rotary_dim, eps, k_buffer, v_buffer, out_cache_loc
) -> None:
    num_tokens, num_layers, _, num_heads, head_dim = kv.shape
    if num_tokens == 0:
        return
    tensors = (kv, k_norm_weight, positions, cos_sin_cache, k_buffer, v_buffer, out_cache_loc)
    _materialize_draft_kv_kernel[(num_tokens, num_layers)](
        *tensors, *strides(*tensors), num_heads, head_dim, eps, HALF_ROT=rotary_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
