"""Training forward of a DFlash draft: ALL anchor blocks of a sequence in one pass.

Keys are the context K/V of every position (from the target features) followed by the blocks'
own K/V; a block-sparse mask lets block j see context positions < a_j and itself (both ways),
never other blocks. Same math as inference, where context K/V comes from the paged cache.
Three attention variants compute the same thing:
- "split" (the trainer's default): scores against the context (masked by anchor) and against the
  block's own B keys are computed separately and share one softmax, so no work is spent on the other
  blocks' keys (with m blocks of B, a dense mask wastes (m-1)*B keys per query);
- "sdpa": SDPA with the dense boolean mask (the plain reference);
- "flex": flex_attention with a block-sparse mask (torch 2.13 has no flex backward on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.models.dflash import DFlashDraftModel
from sglang_dflash.models.rotary import apply_rotary


def block_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """[m*B, seq_len + m*B] bool, True = may attend."""
    m = anchors.shape[0]
    dev = anchors.device
    q_block = torch.arange(m, device=dev).repeat_interleave(block)  # block of each query row
    ctx = torch.arange(seq_len, device=dev)[None, :] < anchors[q_block][:, None]
    k_block = torch.arange(m, device=dev).repeat_interleave(block)
    own = q_block[:, None] == k_block[None, :]
    return torch.cat([ctx, own], dim=1)


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block: int):
    """The same mask as block_mask() as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q, kv):
        qb = q // block
        return torch.where(kv < seq_len, kv < anchors[qb], (kv - seq_len) // block == qb)

    m = anchors.shape[0]
    return create_block_mask(visible, None, None, m * block, seq_len + m * block, device=str(anchors.device))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """q [1, nH, Q, hd], k/v [1, nKV, K, hd]; `mask` from block_mask() (SDPA) or flex_block_mask()."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


def split_block_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
    anchors: torch.Tensor, block: int,
) -> torch.Tensor:
    """q/kb/vb [m*B, heads, hd] (block rows), kc/vc [S, nKV, hd] (context) -> [m*B, nH, hd].
    One softmax over [context < anchor | own block]; scores and probabilities in float32."""
    m, nh, hd = anchors.shape[0], q.shape[1], q.shape[2]
    group = nh // kc.shape[1]
    scale = hd**-0.5
    qh = q.transpose(0, 1)  # [nH, Q, hd]
    kc_h = kc.repeat_interleave(group, dim=1).transpose(0, 1)  # [nH, S, hd]
    vc_h = vc.repeat_interleave(group, dim=1).transpose(0, 1)
    s_ctx = (qh @ kc_h.transpose(1, 2)).float() * scale  # [nH, Q, S]
    visible = torch.arange(kc.shape[0], device=q.device)[None, :] < anchors.repeat_interleave(block)[:, None]
    s_ctx = s_ctx.masked_fill(~visible, float("-inf"))
    qb = q.view(m, block, nh, hd).transpose(1, 2)  # [m, nH, B, hd]
    kb_h = kb.repeat_interleave(group, dim=1).view(m, block, nh, hd).transpose(1, 2)
    vb_h = vb.repeat_interleave(group, dim=1).view(m, block, nh, hd).transpose(1, 2)
    s_blk = (qb @ kb_h.transpose(2, 3)).float() * scale  # [m, nH, B, B]
    s_blk = s_blk.permute(1, 0, 2, 3).reshape(nh, m * block, block)  # [nH, Q, B]
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    p_ctx, p_blk = p.split([kc.shape[0], block], dim=-1)
    out = p_ctx @ vc_h  # [nH, Q, hd]
    p_blk = p_blk.view(nh, m, block, block).transpose(0, 1)  # [m, nH, B, B]
    out_blk = (p_blk @ vb_h).transpose(0, 1).reshape(nh, m * block, hd)
    return (out + out_blk).transpose(0, 1)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_token_id: int):
    """Block token ids [m, B] = [x_a, MASK...] and positions [m, B] = a..a+B-1."""
    cols = torch.arange(block, device=anchors.device)
    positions = anchors[:, None] + cols[None, :]
    ids = torch.where(cols[None, :] == 0, input_ids[anchors][:, None], mask_token_id)
    return ids, positions


def draft_blocks_forward(
    draft: DFlashDraftModel, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor, block: int,
    attention: str = "split",
) -> torch.Tensor:
    """Final hidden states [m*B, H] (before the final norm) of every anchor block of one sequence.
    attention: "split", "sdpa" or "flex" (same result)."""
    seq_len = features.shape[0]
    ctx = draft.project_context(features)
    ids, positions = block_inputs(input_ids, anchors, block, draft.config.mask_token_id)
    h = draft.embed_tokens(ids.flatten()).to(ctx.dtype)
    cos_ctx = draft.cos_sin_cache[:seq_len]
    cos_blk = draft.cos_sin_cache.index_select(0, positions.flatten())
    if attention not in ("split", "sdpa", "flex"):
        raise ValueError(f"attention must be 'split', 'sdpa' or 'flex', got {attention!r}")
    mask = None
    if attention == "sdpa":
        mask = block_mask(anchors, seq_len, block)
    elif attention == "flex":
        mask = flex_block_mask(anchors, seq_len, block)
    for layer in draft.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = apply_rotary(a.q_norm(a.q_proj(x).view(-1, a.nh, a.hd)), cos_blk)
        kb = apply_rotary(a.k_norm(a.k_proj(x).view(-1, a.nkv, a.hd)), cos_blk)
        kc = apply_rotary(a.k_norm(a.k_proj(ctx).view(-1, a.nkv, a.hd)), cos_ctx)
        vc, vb = a.v_proj(ctx).view(-1, a.nkv, a.hd), a.v_proj(x).view(-1, a.nkv, a.hd)
        if mask is None:
            o = split_block_attention(q, kc, vc, kb, vb, anchors, block)
        else:
            k, v = torch.cat([kc, kb]).transpose(0, 1), torch.cat([vc, vb]).transpose(0, 1)
            o = block_attention(q.transpose(0, 1)[None], k[None], v[None], mask, a.nkv != a.nh)[0].transpose(0, 1)
        h = h + a.o_proj(o.reshape(-1, a.nh * a.hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h
