"""Check the pure-torch ``sgl_kernel`` shim against SGLang's own Triton kernels (run in Triton's CPU interpreter).

Run inside the SGLang venv: ``.venv-sglang/bin/python -m pytest cpu_shims/tests``.
Tests that need SGLang/Triton skip elsewhere; the plain semantic tests need
only torch and the shim sources.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SGLang's torch.compile'd helpers run eagerly

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sgl_kernel  # noqa: E402

try:
    import triton  # noqa: F401, E402
    from sglang.kernels.ops.speculative import cache_locs, eagle, multi_layer_eagle, spec_tree  # noqa: E402
    from sglang.srt.mem_cache import allocation  # noqa: E402
    from sglang.srt.speculative.eagle_utils import organize_draft_results  # noqa: E402
    from sglang.srt.speculative.spec_utils import select_top_k_tokens  # noqa: E402

    HAVE_SGLANG = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_SGLANG = False

needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang + triton (the SGLang CPU venv)")


def _ranges(gen: torch.Generator, bs: int, pool_len: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, pool_len - max_len, (bs,), generator=gen)
    lens = torch.randint(0, max_len + 1, (bs,), generator=gen)
    return starts, starts + lens


# ---------------------------------------------------------------- plain semantics


def test_assign_req_to_token_pool_writes_rows_back_to_back() -> None:
    table = torch.zeros(4, 10, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        table,
        torch.tensor([3, 0]),
        torch.tensor([5, 3]),
        torch.tensor([11, 12, 21, 22, 23]),
        10,
    )
    assert table[2, 3:5].tolist() == [11, 12]
    assert table[0, 0:3].tolist() == [21, 22, 23]
    assert int(table.sum()) == 11 + 12 + 21 + 22 + 23


def test_copy_all_layer_kv_cache_reads_before_writing() -> None:
    layers = [torch.arange(8 * 6, dtype=torch.float32).view(8, 2, 3) for _ in range(2)]
    layers.append(torch.arange(8 * 4, dtype=torch.bfloat16).view(8, 4))
    expected = [t.clone() for t in layers]
    src, tgt = torch.tensor([1, 2, 5]), torch.tensor([2, 1, 7])  # swap rows 1 and 2, copy 5 -> 7
    for t in expected:
        t[tgt] = t[src].clone()
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)


def test_fill_accept_out_cache_loc_compacts() -> None:
    out = torch.full((6,), -5, dtype=torch.int64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(
        torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.tensor([10, 11, 12, 13]), out
    )
    assert out.tolist() == [10, 12, 13, -5, -5, -5]


# ---------------------------------------------------------------- against SGLang's Triton kernels


@needs_sglang
@pytest.mark.parametrize("seed", range(3))
def test_assign_req_to_token_pool_matches_triton(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, rows, pool_len = 5, 8, 64
    req = torch.randperm(rows, generator=gen)[:bs]
    starts, ends = _ranges(gen, bs, pool_len, 20)
    locs = torch.randint(0, 1000, (int((ends - starts).sum()),), generator=gen)
    ref = torch.zeros(rows, pool_len, dtype=torch.int32)
    got = ref.clone()
    allocation.assign_req_to_token_pool[(bs,)](req, ref, starts, ends, locs, pool_len, 8)
    sgl_kernel.assign_req_to_token_pool_cpu(req, got, starts, ends, locs, pool_len)
    assert torch.equal(got, ref)


@needs_sglang
@pytest.mark.parametrize("seed", range(3))
def test_assign_extend_cache_locs_matches_triton(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, rows, pool_len = 5, 8, 64
    table = torch.randint(0, 1000, (rows, pool_len), generator=gen, dtype=torch.int32)
    req = torch.randperm(rows, generator=gen)[:bs]
    starts, ends = _ranges(gen, bs, pool_len, 20)
    n = int((ends - starts).sum())
    ref = torch.zeros(n, dtype=torch.int64)
    got = ref.clone()
    cache_locs.assign_extend_cache_locs[(bs,)](req, table, starts, ends, ref, pool_len, 8)
    sgl_kernel.assign_extend_cache_locs_cpu(req, table, starts, ends, got, pool_len)
    assert torch.equal(got, ref)


@needs_sglang
@pytest.mark.parametrize(("topk", "steps"), [(1, 4), (2, 3)])
def test_assign_draft_cache_locs_contiguous_matches_triton(topk: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(topk)
    bs, rows, pool_len = 3, 6, 48
    table = torch.randint(0, 1000, (rows, pool_len), generator=gen, dtype=torch.int32)
    req = torch.randperm(rows, generator=gen)[:bs]
    seq_lens = torch.randint(0, pool_len - topk * steps, (bs,), generator=gen)
    ref = torch.zeros(bs * topk * steps, dtype=torch.int64)
    got = ref.clone()
    cache_locs.assign_draft_cache_locs_contiguous[(bs,)](req, table, seq_lens, ref, pool_len, topk, steps)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(req, table, seq_lens, got, pool_len, topk, steps)
    assert torch.equal(got, ref)


@needs_sglang
def test_fill_bonus_tokens_and_accept_locs_match_triton() -> None:
    gen = torch.Generator().manual_seed(0)
    bs, width = 4, 5
    tokens = torch.randint(0, 100, (bs, width), generator=gen)
    lens = torch.randint(1, width + 1, (bs,), generator=gen, dtype=torch.int32)
    ref, got = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    eagle.fill_bonus_tokens[(bs,)](tokens, lens, ref, width)
    sgl_kernel.fill_bonus_tokens_cpu(tokens, lens, got, width)
    assert torch.equal(got, ref)

    index = torch.arange(bs * width).view(bs, width)
    index[torch.arange(width)[None, :] >= lens[:, None]] = -1
    locs = torch.randint(0, 1000, (bs * width,), generator=gen)
    ref, got = torch.full((bs * width,), -7), torch.full((bs * width,), -7)
    eagle.fill_accept_out_cache_loc[(bs * width,)](index, locs, ref, 32)
    sgl_kernel.fill_accept_out_cache_loc_cpu(index, locs, got)
    assert torch.equal(got, ref)


@needs_sglang
@pytest.mark.parametrize("with_select", [False, True])
def test_rotate_input_ids_matches_triton(with_select: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    lens = torch.tensor([3, 0, 5, 1])
    starts = torch.cumsum(lens, 0) - lens
    ids = torch.randint(0, 100, (int(lens.sum()),), generator=gen)
    new = torch.randint(100, 200, (lens.numel(),), generator=gen)
    select = (starts + (lens - 2).clamp_min(0)) if with_select else None
    ref, got = ids.clone(), ids.clone()
    multi_layer_eagle.rotate_input_ids_kernel[(lens.numel(),)](ref, starts, lens, new, select, BLOCK_SIZE=8)
    sgl_kernel.rotate_input_ids_cpu(got, starts, lens, new, select)
    assert torch.equal(got, ref)


def _eagle_tree(gen: torch.Generator, bs: int, topk: int, steps: int, n: int, vocab: int = 6):
    """Draft results shaped exactly as SGLang's EAGLE worker produces them."""
    scores, hidden = None, torch.zeros(bs, 1)
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        rows = bs if i == 0 else bs * topk
        probs = torch.rand(rows, vocab, generator=gen).softmax(-1)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        _, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
    return organize_draft_results(score_list, token_list, parents_list, n)


@needs_sglang
@pytest.mark.parametrize(("topk", "steps", "n"), [(1, 3, 4), (2, 3, 5), (3, 4, 8)])
@pytest.mark.parametrize("mode", [spec_tree.TreeMaskMode.FULL_MASK, spec_tree.TreeMaskMode.QLEN_ONLY])
def test_build_and_verify_tree_match_triton(topk: int, steps: int, n: int, mode: int) -> None:
    gen = torch.Generator().manual_seed(topk * 100 + n)
    bs = 3
    parent_list, selected, draft = _eagle_tree(gen, bs, topk, steps, n)
    seq_lens = torch.tensor([5, 2, 7])
    mask_len = int(seq_lens.sum()) * n + n * n * bs if mode == spec_tree.TreeMaskMode.FULL_MASK else n * n * bs

    def build(fn):
        mask = torch.ones(mask_len, dtype=torch.bool)
        positions = torch.empty(bs * n, dtype=torch.long)
        retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
        fn(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, steps, n, mode)
        return mask, positions, retrieve

    ref = build(spec_tree.sgl_build_tree_kernel_triton)
    got = build(sgl_kernel.build_tree_kernel_efficient_cpu)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)

    retrieve = ref[2]
    candidates = torch.cat([torch.full((bs, 1), 99), draft], dim=1)
    # Target agrees with the first child on the path for some requests, not all.
    target = candidates.clone().view(-1)
    target = torch.where(torch.rand(target.shape, generator=gen) < 0.7, target.roll(-1), target)

    def verify(fn):
        predicts = torch.full((bs * n,), -1, dtype=torch.int32)
        accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        fn(predicts, accept_index, accept_num, candidates, *retrieve, target.view(bs, n))
        return predicts, accept_index, accept_num

    ref_v = verify(spec_tree.verify_tree_greedy_triton)
    got_v = verify(sgl_kernel.verify_tree_greedy_cpu)
    for a, b in zip(got_v, ref_v, strict=True):
        assert torch.equal(a, b)
