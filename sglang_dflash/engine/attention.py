"""Attention backends. The torch backend pads the ragged batch and runs SDPA with a causal mask
over each request's cached prefix gathered from the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_dflash.engine.forward_batch import ForwardBatch


@dataclass
class AttentionMetadata:
    kv_indices: torch.Tensor  # [bs, max_kv] token slots (0 = padding)
    mask: torch.Tensor | None  # [bs, 1, max_q, max_kv] bool, True = attend; None = no masking needed
    q_pad_index: torch.Tensor | None  # [T] index of each flat token in the padded [bs * max_q]
    max_q: int


class TorchNativeAttnBackend:
    """Plain torch SDPA. Works on every device; other backends implement the same two methods."""

    def init_forward_metadata(self, fb: ForwardBatch, req_to_token: torch.Tensor) -> AttentionMetadata:
        device = fb.input_ids.device
        bs = fb.batch_size
        max_kv = max(fb.seq_lens_cpu)
        max_q = max(fb.extend_seq_lens_cpu)
        kv_indices = req_to_token[fb.req_pool_indices, :max_kv]
        kv_pos = torch.arange(max_kv, device=device)
        if bs == 1 and max_q == 1:
            return AttentionMetadata(kv_indices, None, None, 1)
        q_pos = torch.arange(max_q, device=device)
        limit = fb.extend_prefix_lens[:, None] + q_pos[None, :]  # [bs, max_q] last visible position
        limit = torch.minimum(limit, (fb.seq_lens - 1)[:, None])
        mask = kv_pos[None, None, :] <= limit[:, :, None]
        q_pad_index = None
        if bs > 1 or max_q != fb.extend_seq_lens_cpu[0]:
            starts = torch.arange(bs, device=device) * max_q
            q_pad_index = torch.repeat_interleave(starts, fb.extend_seq_lens) + _ragged_arange(
                fb.extend_seq_lens
            )
        return AttentionMetadata(kv_indices, mask[:, None], q_pad_index, max_q)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, nH, hd]; k_cache/v_cache [slots, nKV, hd] of one layer (new tokens already written)."""
        bs = meta.kv_indices.shape[0]
        T, nh, hd = q.shape
        k = k_cache[meta.kv_indices].transpose(1, 2)  # [bs, nKV, max_kv, hd]
        v = v_cache[meta.kv_indices].transpose(1, 2)
        if meta.q_pad_index is None:
            qp = q.view(bs, meta.max_q, nh, hd)
        else:
            qp = q.new_zeros(bs * meta.max_q, nh, hd).index_copy_(0, meta.q_pad_index, q)
            qp = qp.view(bs, meta.max_q, nh, hd)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k, v, attn_mask=meta.mask, scale=scale, enable_gqa=k.shape[1] != nh
        )
        out = out.transpose(1, 2).reshape(bs * meta.max_q, nh * hd)
        return out if meta.q_pad_index is None else out.index_select(0, meta.q_pad_index)


def _ragged_arange(lens: torch.Tensor) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for lens [l0, l1, ...]."""
    total = int(lens.sum())
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(total, device=lens.device) - starts
