"""Speculative-decoding operators of SGLang's CPU path (EAGLE-family workers), in plain torch.

Each function mirrors the argument order of the SGLang call site that uses it
(``sglang/kernels/ops/speculative/*.py``) and mutates its output arguments in
place. Host loops appear only where the work is inherently per request and
tiny (tree building and tree verification).
"""

from __future__ import annotations

import torch

from sgl_kernel.memory import segment_positions

_FULL_MASK = 0
_QLEN_ONLY = 1


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each request's extend segment left by one and put its new token last.

    Request i owns ``input_ids[s:s+n]`` (``s = extend_start_loc[i]``,
    ``n = extend_seq_lens[i]``): ids move one place left, then
    ``topk_index[i]`` is written at ``select_index[i]`` (when given) or at
    ``s + n - 1``. Requests with ``n == 0`` are untouched.
    """
    starts = extend_start_loc.reshape(-1).to(torch.int64)
    lens = extend_seq_lens.reshape(-1).to(torch.int64)
    seg, dst, _ = segment_positions(starts, starts + (lens - 1).clamp_min(0))
    del seg
    if dst.numel():
        input_ids[dst] = input_ids[dst + 1].clone()
    nonempty = lens > 0
    if select_index is not None:
        last = select_index.reshape(-1).to(torch.int64)
    else:
        last = starts + lens - 1
    new_tokens = topk_index.reshape(lens.numel(), -1)[:, 0]
    input_ids[last[nonempty]] = new_tokens[nonempty].to(input_ids.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Last accepted token: ``bonus_tokens[i] = accept_tokens.flat[accept_stride*i + accept_lens[i] - 1]``."""
    lens = accept_lens.reshape(-1).to(torch.int64)
    idx = torch.arange(lens.numel(), device=lens.device) * accept_stride + lens - 1
    bonus_tokens.reshape(-1)[: lens.numel()] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the KV slots of accepted tokens.

    Entries of ``accept_index`` (flattened) that are not -1 index
    ``out_cache_loc``; their slots are written to ``accept_out_cache_loc`` in
    order, without gaps.
    """
    idx = accept_index.reshape(-1).to(torch.int64)
    idx = idx[idx != -1]
    accept_out_cache_loc.reshape(-1)[: idx.numel()] = out_cache_loc.reshape(-1)[idx].to(accept_out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Copy each request's next ``w = topk * num_cols`` table slots from ``seq_lens[i]`` on.

    ``out_cache_loc[i*w:(i+1)*w] = req_to_token[req_pool_indices[i], seq_lens[i]:seq_lens[i] + w]``.
    """
    del pool_len  # implied by req_to_token's shape
    width = topk * num_cols
    bs = seq_lens.numel()
    if bs == 0 or width == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    cols = seq_lens.reshape(-1).to(torch.int64)[:, None] + torch.arange(width, device=seq_lens.device)
    out_cache_loc.reshape(-1)[: bs * width] = req_to_token[rows[:, None], cols].reshape(-1).to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's table slots ``[start_offset[i], end_offset[i])`` into ``out_cache_loc``.

    Inverse of :func:`sgl_kernel.memory.assign_req_to_token_pool_cpu`: the
    slices are written back to back in batch order.
    """
    del pool_len  # implied by req_to_token's shape
    seg, cols, _ = segment_positions(start_offset, end_offset)
    if seg.numel() == 0:
        return
    rows = req_pool_indices.reshape(-1).to(torch.int64)[seg]
    out_cache_loc.reshape(-1)[: seg.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def _tree_parent_position(selected: list[int], parents: list[int], node: int, topk: int) -> int | None:
    """1-based position of the parent of draft node ``node`` (0 = the root), or None if not found."""
    parent_tb = selected[node] // topk
    if parent_tb == 0:
        return 0
    parent_token = parents[parent_tb]
    for pos, sel in enumerate(selected):
        if sel == parent_token:
            return pos + 1
    return None


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE draft tree: positions, retrieve links and attention mask.

    Node 0 of request b is its verified last token; node i > 0 is
    ``selected_index[b, i-1]``, whose parent is ``selected_index[b, i-1] // topk``
    looked up through ``parent_list``. ``retrieve_next_token`` /
    ``retrieve_next_sibling`` (pre-filled with -1 by the caller) encode the
    tree as first-child / next-sibling lists. ``tree_mask_mode`` 0 writes the
    draft part of a full ``[seq_len + n]``-wide mask per draft row, mode 1 an
    ``n x n`` mask per request; mode 2 (bit-packed) is not supported.
    """
    if int(tree_mask_mode) not in (_FULL_MASK, _QLEN_ONLY):
        raise NotImplementedError(
            f"build_tree_kernel_efficient_cpu: tree_mask_mode={int(tree_mask_mode)} is not supported"
        )
    n = draft_token_num
    seq_lens = verified_seq_len.reshape(-1).tolist()
    sel_rows = selected_index.reshape(len(seq_lens), -1).tolist()
    par_rows = parent_list.reshape(len(seq_lens), -1).tolist() if parent_list.numel() else []
    mask = tree_mask.reshape(-1)
    pos_out = positions.reshape(-1)
    r_index = retrieve_index.reshape(-1)
    r_next = retrieve_next_token.reshape(-1)
    r_sib = retrieve_next_sibling.reshape(-1)
    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        selected = sel_rows[b][: n - 1]
        parents = par_rows[b] if par_rows else []
        base = b * n
        pos_out[base] = seq_len
        r_index[base] = base
        for i in range(n - 1, 0, -1):
            r_index[base + i] = base + i
            parent_pos = _tree_parent_position(selected, parents, i - 1, topk)
            if parent_pos is None:
                continue
            first_child = int(r_next[base + parent_pos])
            r_next[base + parent_pos] = i
            if first_child != -1:
                r_sib[base + i] = first_child
        for x in range(n):
            if int(tree_mask_mode) == _FULL_MASK:
                row = n * n * b + prefix * n + (seq_len + n) * x + seq_len
            else:
                row = n * n * b + n * x
            mask[row : row + n] = False
            mask[row] = True
            if x == 0:
                continue
            cur, level = x - 1, 0
            for _ in range(depth):
                level += 1
                mask[row + 1 + cur] = True
                parent_pos = _tree_parent_position(selected, parents, cur, topk)
                if parent_pos is None or parent_pos == 0:
                    break
                cur = parent_pos - 1
            pos_out[base + x] = level + seq_len
        prefix += seq_len


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: walk down the draft tree while a child matches the target's argmax.

    ``candidates``/``retrive_*`` are ``[bs, n]``; ``target_predict`` holds the
    target's greedy token at every flat node ``b*n + j``. Writes the accepted
    flat node indices to ``accept_index[b, 0..k]`` (slot 0 is the root), the
    number of accepted draft tokens ``k`` to ``accept_token_num[b]``, and the
    target token after each accepted node to ``predicts`` (flat).
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.reshape(-1)
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, steps):
            cur = r_next[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = r_sib[b][cur]
            if cur == -1:
                break
            pred[last] = want
            accepted += 1
            last = r_index[b][cur]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        pred[last] = target[last]
