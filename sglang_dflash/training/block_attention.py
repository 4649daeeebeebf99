"""Training forward of a DFlash draft: ALL anchor blocks of a sequence in one pass.

The layers are the draft's own (`DraftLayer.forward`, shared with inference); only the keys differ:
here the context K/V of every position (from the target features) followed by the blocks' own K/V,
where block j sees context positions < a_j and itself (both ways), never other blocks (inference
reads the context K/V from the paged cache). Three attention variants compute the same thing:
- "split" (the trainer's default): scores against the context (masked by anchor) and against the
  block's own B keys are computed separately and share one softmax, so no work is spent on the other
  blocks' keys (with m blocks of B, a dense mask wastes (m-1)*B keys per query);
- "sdpa": SDPA with the dense boolean mask (the plain reference);
- "flex": flex_attention with a block-sparse mask (torch 2.13 has no flex backward on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.models.dflash import DFlashDraftModel, DraftAttention, block_input_ids
from sglang_dflash.models.rotary import rope_at


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


class AnchorBlockAttention:
    """Training keys of m anchor blocks of one sequence: each layer's context K/V of every position (its
    own `project_kv` of ctx), then the blocks' own K/V; block j sees context < a_j and itself."""

    uses_rope = True  # `project` rotates with the layers' rope

    def __init__(self, draft: DFlashDraftModel, ctx: torch.Tensor, anchors: torch.Tensor, block: int, attention: str):
        if attention not in ("split", "sdpa", "flex"):
            raise ValueError(f"attention must be 'split', 'sdpa' or 'flex', got {attention!r}")
        seq_len = ctx.shape[0]
        self.ctx, self.anchors, self.block = ctx, anchors, block
        self.rope_ctx = rope_at(draft.rope, torch.arange(seq_len, device=ctx.device))
        self.mask = None
        if attention == "sdpa":
            self.mask = block_mask(anchors, seq_len, block)
        elif attention == "flex":
            self.mask = flex_block_mask(anchors, seq_len, block)

    def project(
        self, attn: DraftAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return attn.project_qkv(x, rope)

    def __call__(self, attn: DraftAttention, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        if attn.causal or attn.sliding_window is not None:
            raise ValueError(f"draft layer {attn.layer_id} is causal or sliding-window: training supports "
                             "full-attention, non-causal draft layers only")
        kc, vc = attn.project_kv(self.ctx, self.rope_ctx)
        if self.mask is None:
            return split_block_attention(q, kc, vc, kb, vb, self.anchors, self.block)
        k, v = torch.cat([kc, kb]).transpose(0, 1)[None], torch.cat([vc, vb]).transpose(0, 1)[None]
        return block_attention(q.transpose(0, 1)[None], k, v, self.mask, attn.nkv != attn.nh)[0].transpose(0, 1)


def draft_blocks_forward(
    draft: DFlashDraftModel, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor, block: int,
    attention: str = "split",
) -> torch.Tensor:
    """Final hidden states [m*B, H] (before the final norm) of every anchor block [x_a, MASK...] at
    positions a..a+B-1 of one sequence. attention: "split", "sdpa" or "flex" (same result)."""
    ctx = draft.project_context(features)
    attend = AnchorBlockAttention(draft, ctx, anchors, block, attention)
    ids = block_input_ids(input_ids[anchors], block, draft.config.mask_token_id)
    positions = anchors[:, None] + torch.arange(block, device=anchors.device)[None, :]
    h = draft.embed(ids.flatten()).to(ctx.dtype)
    return draft.run_layers(h, positions.flatten(), attend)
