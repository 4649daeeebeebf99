"""Attention backends. The torch backend splits a ragged batch into the longest blocks, attending as one
padded group, and every other token as a 1-token row (see `padded_rows`). 1-token rows read K/V straight from
the paged pool (`kernels.decode_attention`); a padded group gathers its requests' K/V and uses batched GEMMs
(short queries: verify blocks) or SDPA (prefill)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_dflash.device import upload
from sglang_dflash.kernels.decode_attention import attends_in_tiles, decode_attention, reads_runs
from sglang_dflash.runtime.forward_batch import ForwardBatch

# Up to this many query tokens per request, two small GEMMs + softmax beat CPU SDPA (up to 15x in bf16).
SMALL_Q = 64
# Layout costs, in K/V positions gathered or scored per layer: a 1-token row costs its max_kv; a padded query
# position about half that; a second group a fixed ~5-8 ms a step. By K/V element size: in bf16 (a 2-core AMX CPU,
# 30 layers) the group costs what ~8 rows of 320 positions cost; in float32 (a 2-core AVX2 CPU, where a row moves
# twice the bytes) ~600 positions (a least-squares fit over 48 layouts of 16-40 rows at 150-600 positions).
GROUP_COST = {2: 2560, 4: 600}
PADDED_POSITION_COST = 0.5


@dataclass
class AttentionMetadata:
    kv_rows: torch.Tensor  # [bs * nKV * max_kv] rows of a layer's K/V cache viewed as [slots * nKV, hd]
    bias: torch.Tensor  # [bs, 1, max_q, max_kv] additive mask in the model dtype: 0 = attend, -inf = not
    q_pad_index: torch.Tensor | None  # [T] index of each flat token in the padded [bs * max_q]; None = no padding
    k: torch.Tensor  # [bs, nKV, max_kv, hd] workspaces the gathered K/V of each layer are written to
    v: torch.Tensor
    max_q: int


@dataclass
class DecodeRowsMetadata:
    """1-token rows: row i attends to positions [0, seq_lens[i]) of request req_pool_indices[i]."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    req_to_token: torch.Tensor
    max_seq_len: int  # a host-side bound of seq_lens


@dataclass
class GroupedMetadata:
    """A batch mixing 1-token rows (decode) with longer ones (verify blocks, prefill): each group attends on
    its own, so the 1-token rows are not padded to the longest row. groups: (token indices [t] of the
    group in the flat batch, or None for the whole batch; its metadata)."""

    groups: list[tuple[torch.Tensor | None, AttentionMetadata | DecodeRowsMetadata]]


class TorchNativeAttnBackend:
    """Plain torch ops. Works on every device; other backends implement the same two methods."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def init_forward_metadata(
        self, fb: ForwardBatch, req_to_token: torch.Tensor, dtype: torch.dtype
    ) -> GroupedMetadata:
        """The requests with the longest blocks attend as one padded group; every token of the others is a
        1-token row over its own causal prefix (its K/V is in the pool before attention), so a few short
        blocks among decode rows cost a few rows, not a second group padded to the longest block. Where the
        decode kernel reads a request's consecutive rows together (the C++ CPU kernel), every block up to SMALL_Q
        tokens goes as 1-token rows: measured on a 2-core CPU (bf16, 200-400 positions), a step 3-15 ms faster
        than padded groups at 4-32 requests with 1-8 blocks of 4-16 tokens among them, and 2-6 ms at one request
        (4-16 tokens); about even (+3%) for 4 blocks of 16 alone."""
        lens = fb.extend_seq_lens_cpu
        if max(lens) == 1:
            padded = []
        elif attends_in_tiles(fb.input_ids.device, self.head_dim):
            padded = []
        elif reads_runs(fb.input_ids.device):
            padded = [i for i, n in enumerate(lens) if n > SMALL_Q]
        elif min(lens) == max(lens):
            padded = list(range(len(lens)))
        else:
            padded = padded_rows(lens, fb.max_seq_len, group_cost(dtype))
        if max(lens) == 1 or len(padded) == len(lens):
            rows = (fb.req_pool_indices, fb.extend_prefix_lens, fb.seq_lens)
            return GroupedMetadata([(None, self._metadata(fb, rows, lens, req_to_token, dtype))])
        token_rows = torch.repeat_interleave(fb.req_pool_indices, fb.extend_seq_lens, output_size=len(fb.positions))
        if not padded:
            one = (token_rows, fb.positions, fb.positions + 1)
            return GroupedMetadata([(None, self._metadata(fb, one, [1] * len(fb.positions), req_to_token, dtype))])
        device = fb.input_ids.device
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        single = sorted(set(range(len(lens))) - set(padded))
        tokens = upload([t for i in single for t in range(starts[i], starts[i + 1])], torch.int64, device)
        positions = fb.positions.index_select(0, tokens)
        one = (token_rows.index_select(0, tokens), positions, positions + 1)
        groups = [(tokens, self._metadata(fb, one, [1] * len(tokens), req_to_token, dtype))]
        tokens = upload([t for i in padded for t in range(starts[i], starts[i + 1])], torch.int64, device)
        idx = upload(padded, torch.int64, device)
        rows = tuple(x.index_select(0, idx) for x in (fb.req_pool_indices, fb.extend_prefix_lens, fb.seq_lens))
        groups.append((tokens, self._metadata(fb, rows, [lens[i] for i in padded], req_to_token, dtype)))
        return GroupedMetadata(groups)

    def _metadata(
        self, fb: ForwardBatch, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lens: list[int],
        req_to_token: torch.Tensor, dtype: torch.dtype,
    ) -> AttentionMetadata | DecodeRowsMetadata:
        """Metadata of rows (req_pool_indices, prefix_lens, seq_lens) extended by `lens` tokens each."""
        device = fb.input_ids.device
        req_pool_indices, prefix_lens, seq_lens = rows
        if max(lens) == 1:
            return DecodeRowsMetadata(req_pool_indices, seq_lens, req_to_token, fb.max_seq_len)
        ext_lens = seq_lens - prefix_lens
        bs, nkv = len(lens), self.num_kv_heads
        max_kv = fb.max_seq_len
        max_q = max(lens)
        slots = req_to_token[req_pool_indices, :max_kv]
        kv_rows = (slots[:, None, :] * nkv + torch.arange(nkv, device=device)[None, :, None]).reshape(-1)
        kv_pos = torch.arange(max_kv, device=device)
        q_pos = torch.arange(max_q, device=device)
        limit = prefix_lens[:, None] + q_pos[None, :]  # [bs, max_q] last visible position
        limit = torch.minimum(limit, (seq_lens - 1)[:, None])
        hidden = kv_pos[None, None, :] > limit[:, :, None]
        bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        q_pad_index = None
        if any(e != max_q for e in lens):
            total = sum(lens)
            starts = torch.arange(bs, device=device) * max_q
            q_pad_index = torch.repeat_interleave(starts, ext_lens, output_size=total) + _ragged_arange(
                ext_lens, total
            )
        k, v = torch.empty(2, bs, nkv, max_kv, self.head_dim, dtype=dtype, device=device)
        return AttentionMetadata(kv_rows, bias[:, None], q_pad_index, k, v, max_q)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: GroupedMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, nH, hd]; k_cache/v_cache [slots, nKV, hd] of one layer (new tokens already written).
        Returns [T, nH * hd]."""
        if len(meta.groups) == 1:
            return self._attend(q, k_cache, v_cache, meta.groups[0][1], scale)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for tokens, group in meta.groups:
            out.index_copy_(0, tokens, self._attend(q.index_select(0, tokens), k_cache, v_cache, group, scale))
        return out

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata | DecodeRowsMetadata, scale: float,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeRowsMetadata):
            out = decode_attention(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens, scale,
                                   meta.max_seq_len)
            return out.to(q.dtype).view(q.shape[0], -1)
        bs, nkv, _, hd = meta.k.shape
        nh, max_q = q.shape[1], meta.max_q
        k = torch.index_select(k_cache.view(-1, hd), 0, meta.kv_rows, out=meta.k.view(-1, hd)).view(meta.k.shape)
        v = torch.index_select(v_cache.view(-1, hd), 0, meta.kv_rows, out=meta.v.view(-1, hd)).view(meta.v.shape)
        if meta.q_pad_index is not None:
            q = q.new_zeros(bs * max_q, nh, hd).index_copy_(0, meta.q_pad_index, q)
        if max_q <= SMALL_Q:
            out = _gemm_attention(q.view(bs, max_q, nh, hd), k, v, meta.bias, scale)
        else:
            out = F.scaled_dot_product_attention(
                q.view(bs, max_q, nh, hd).transpose(1, 2), k, v, attn_mask=meta.bias, scale=scale,
                enable_gqa=nkv != nh,
            ).transpose(1, 2)
        out = out.reshape(bs * max_q, nh * hd)
        return out if meta.q_pad_index is None else out.index_select(0, meta.q_pad_index)


def _gemm_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [bs, Q, nH, hd], k/v [bs, nKV, L, hd], bias [bs, 1, Q, L] -> [bs, Q, nH, hd] (as a view whose
    reshape to [bs * Q, nH * hd] is right). Query heads sharing a KV head are stacked on the row dim, so
    K/V are never repeated. The GEMMs run in the cache dtype and the softmax in float32 (like HF eager
    attention): converting K/V to float32 first cost 1.5-12x more at decode batch 48 (measured on CPU)."""
    bs, nq, nh, hd = q.shape
    nkv, g = k.shape[1], nh // k.shape[1]
    if nq == 1:  # decode: the head split is a plain view
        qg = q.view(bs, nkv, g, hd)
    else:
        qg = q.view(bs, nq, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(bs, nkv, g * nq, hd)
    scores = torch.matmul(qg.to(k.dtype), k.transpose(-1, -2)).view(bs, nkv, g, nq, -1)
    probs = torch.add(bias[:, :, None].float(), scores.float(), alpha=scale).softmax(-1)
    out = torch.matmul(probs.view(bs, nkv, g * nq, -1).to(v.dtype), v).to(q.dtype)  # [bs, nKV, g * Q, hd]
    return out if nq == 1 else out.view(bs, nkv, g, nq, hd).permute(0, 3, 1, 2, 4)


def group_cost(dtype: torch.dtype) -> int:
    """GROUP_COST for K/V of this dtype (the bf16 figure for other sizes)."""
    return GROUP_COST.get(dtype.itemsize, GROUP_COST[2])


def padded_rows(lens: list[int], max_kv: int, group: int = GROUP_COST[2]) -> list[int]:
    """The rows (sorted) that attend as a padded group: the k longest, k chosen by the layout costs above.
    Rows longer than SMALL_Q (prefill chunks, for SDPA) are always padded; 1-token rows never are."""
    order = sorted((i for i, n in enumerate(lens) if n > 1), key=lambda i: -lens[i])
    forced = sum(lens[i] > SMALL_Q for i in order)
    best, best_cost = forced, None
    singles = sum(lens[i] for i in order[forced:]) + len(lens) - len(order)  # tokens left as 1-token rows
    for k in range(forced, len(order) + 1):
        if k > forced:
            singles -= lens[order[k - 1]]
        cost = singles * max_kv
        if k:
            cost += k * lens[order[0]] * PADDED_POSITION_COST * max_kv + (group if singles else 0)
        if best_cost is None or cost < best_cost:
            best, best_cost = k, cost
    return sorted(order[:best])


def _ragged_arange(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[0..l0-1, 0..l1-1, ...] for lens [l0, l1, ...] summing to total (no device sync)."""
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens, output_size=total)
    return torch.arange(total, device=lens.device) - starts
