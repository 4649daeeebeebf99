"""KV-cache bookkeeping operators: request-to-token table writes and slot-to-slot KV copies."""

from __future__ import annotations

import ctypes

import torch


def segment_positions(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten per-request ranges ``[starts[i], ends[i])``.

    Returns ``(seg, cols, lens)``: for every covered position its request index
    ``seg`` and column ``cols`` (request order, then ascending), and the
    per-request lengths (negative ranges count as empty).
    """
    starts = starts.reshape(-1).to(torch.int64)
    lens = (ends.reshape(-1).to(torch.int64) - starts).clamp_min(0)
    total = int(lens.sum())
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, device=lens.device) - first[seg]
    return seg, starts[seg] + within, lens


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write request i's new KV slots into its table row.

    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` receives
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``,
    which holds the slots of all requests back to back in batch order.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token must be [rows, {pool_len}], got {tuple(req_to_token.shape)}")
    seg, cols, _ = segment_positions(start_offset, end_offset)
    if seg.numel() == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)[seg]
    values = out_cache_loc.reshape(-1)[: seg.numel()].to(req_to_token.dtype)
    req_to_token[rows, cols] = values


def _byte_rows(ptr: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A writable ``[num_rows, row_bytes]`` uint8 view of host memory at ``ptr`` (no copy)."""
    buf = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc[j] -> tgt_loc[j]`` in every buffer listed in ``data_ptrs``.

    ``data_ptrs[b]`` is the address of buffer b (a contiguous CPU tensor whose
    first dimension is the KV slot) and ``strides[b]`` its row size in bytes.
    All source rows of a buffer are read before any target row is written, so
    overlapping source and target sets are safe.
    """
    if data_ptrs.device.type != "cpu":
        raise ValueError("copy_all_layer_kv_cache_cpu needs CPU buffers")
    src = src_loc.reshape(-1).to(torch.int64)
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    if src.numel() != tgt.numel():
        raise ValueError(f"src_loc has {src.numel()} entries, tgt_loc {tgt.numel()}")
    if src.numel() == 0:
        return
    if int(torch.minimum(src.min(), tgt.min())) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu got a negative slot index")
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _byte_rows(int(ptr), int(row_bytes), num_rows)
        rows.index_copy_(0, tgt, rows.index_select(0, src))
