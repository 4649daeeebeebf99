"""Triton version of `decode_attention` (CUDA/XPU): one program per (row, KV head) reads the row's slots from
`req_to_token` and their K/V rows straight from the paged pool, BLOCK_N positions at a time, with an online
float32 softmax over the query heads that share the KV head. No gathered, padded copy of K/V, and no bound on
the positions known on the host: each program loops to its own seq_len."""

import torch
import triton
import triton.language as tl

from sglang_dflash.kernels.backend import strides

BLOCK_N = 64


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr, out_ptr,
    q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, table_s0, table_s1, rows_s0, lens_s0, out_s0, out_s1,
    out_s2, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + b * rows_s0).to(tl.int64)
    n = tl.load(lens_ptr + b * lens_s0).to(tl.int64)
    heads = tl.arange(0, G_PAD)
    dims = tl.arange(0, HD_PAD)
    head_ok = heads < G
    dim_ok = dims < HD
    q = tl.load(q_ptr + b * q_s0 + (h * G + heads)[:, None] * q_s1 + dims[None, :] * q_s2,
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale  # [G_PAD, HD_PAD]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
    for start in range(0, n, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        pos_ok = pos < n
        slots = tl.load(table_ptr + row * table_s0 + pos * table_s1, mask=pos_ok, other=0).to(tl.int64)
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + slots[:, None] * k_s0 + h * k_s1 + dims[None, :] * k_s2, mask=kv_ok,
                    other=0.0).to(tl.float32)  # [BLOCK, HD_PAD]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slots[:, None] * v_s0 + h * v_s1 + dims[None, :] * v_s2, mask=kv_ok,
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees no position: zeros
    tl.store(out_ptr + b * out_s0 + (h * G + heads)[:, None] * out_s1 + dims[None, :] * out_s2, out,
             mask=head_ok[:, None] & dim_ok[None, :])


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`decode_attention` on the device: [bs, nH, hd] float32."""
    bs, nh, hd = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    out = torch.empty(bs, nh, hd, dtype=torch.float32, device=q.device)
    if bs == 0:
        return out
    _decode_attention_kernel[(bs, nkv)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, out,
        *strides(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, out), scale,
        G=g, G_PAD=triton.next_power_of_2(g), HD=hd, HD_PAD=triton.next_power_of_2(hd), BLOCK=BLOCK_N,
    )
    return out
