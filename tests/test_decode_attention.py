"""Decode attention from the paged pool (`kernels.decode_attention`): the CPU C++ kernel, the Triton kernel
(CUDA/XPU; here through the Triton interpreter) and the torch reference against per-row float64 softmax
attention, on random pools with odd shapes, int32/int64 slot tables, bf16 and float32 caches, non-contiguous
queries and empty rows (the C++ kernel's bf16 dot-product path against softmax weights rounded to bf16, as it
rounds them)."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_dflash.device import accelerator
from sglang_dflash.kernels.backend import triton_available, triton_import_error
from sglang_dflash.kernels.cpu_extensions import cpu_extension
from sglang_dflash.kernels.decode_attention import decode_attention, decode_attention_torch

DEVICE = accelerator() or torch.device("cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported


def per_row(q, k_cache, v_cache, req_to_token, rows, seq_lens, scale, bf16_weights=False):
    """Per-row float64 attention; bf16_weights: the softmax weights rounded (float32, then bf16) before p . v, as the
    C++ kernel's bf16 dot-product path does (`dot_path`)."""
    bs, nh, hd = q.shape
    g = nh // k_cache.shape[1]
    out = torch.zeros(bs, nh, hd, dtype=torch.float64)
    for i in range(bs):
        slots = req_to_token[rows[i], : seq_lens[i]].long()
        if len(slots) == 0:
            continue
        k = k_cache[slots].double().repeat_interleave(g, 1)  # [L, nH, hd]
        v = v_cache[slots].double().repeat_interleave(g, 1)
        w = torch.einsum("hd,lhd->hl", q[i].double(), k).mul(scale).softmax(-1)
        if bf16_weights:
            w = w.float().bfloat16().double()
        out[i] = torch.einsum("hl,lhd->hd", w, v)
    return out


def dot_path(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel takes its bf16 dot-product path here (AVX512-BF16, bf16 q and cache, head dim a multiple
    of 32): the softmax weights are then rounded to bf16 for p . v."""
    ext = cpu_extension("decode_attention")
    return q.dtype == k_cache.dtype == torch.bfloat16 and ext is not None and ext.dot_bf16(q.shape[-1])


SHAPES = [(1, 1, 1, 64), (5, 3, 3, 64), (7, 2, 4, 128), (3, 1, 5, 40), (9, 4, 2, 80), (6, 2, 3, 96)]  # bs, nKV, g, hd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", ["kernel", "triton", "torch"])
def test_matches_per_row_attention(impl: str, shape: tuple, dtype: torch.dtype, force_kernels):
    bs, nkv, g, hd = shape
    gen = torch.Generator().manual_seed(bs * 1000 + hd)
    slots, reqs, ctx = 700, 6, 97
    k_cache = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    v_cache = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    table = torch.randperm(slots, generator=gen)[: reqs * ctx].view(reqs, ctx)
    table = table.to(torch.int32 if bs % 2 else torch.int64)
    rows = torch.randint(0, reqs, (bs,), generator=gen)
    seq_lens = torch.randint(0, ctx + 1, (bs,), generator=gen)
    seq_lens[0] = ctx
    if bs > 2:
        seq_lens[1] = 0  # an empty row gives zeros
    q = torch.randn(bs, nkv * g, 2 * hd, generator=gen).to(dtype)[:, :, ::2]  # non-contiguous
    scale = hd**-0.5
    if impl == "kernel":
        if DEVICE.type != "cpu":
            pytest.skip("the C++ kernel serves CPU engines (not built by the device check)")
        assert cpu_extension("decode_attention") is not None, "the CPU kernel did not build"
        got = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale, ctx)
    elif impl == "triton":
        if not triton_available():
            pytest.skip(f"triton unusable: {triton_import_error()}")
        force_kernels("triton")
        device_args = [x.to(DEVICE) for x in (q, k_cache, v_cache, table, rows, seq_lens)]
        got = decode_attention(*device_args, scale, ctx).cpu()
    else:
        got = decode_attention_torch(q, k_cache, v_cache, table, rows, seq_lens, scale, ctx)
    assert got.dtype == torch.float32 and got.shape == (bs, nkv * g, hd)
    want = per_row(q, k_cache, v_cache, table, rows, seq_lens, scale, impl == "kernel" and dot_path(q, k_cache))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_request_read_together_match_alone(dtype: torch.dtype):
    """Consecutive rows of one request (a verify block's tokens as 1-token rows: the C++ kernel reads the context
    once for them, in runs of up to 16) against the reference, and each row bit-identical to the row alone."""
    if DEVICE.type != "cpu" or cpu_extension("decode_attention") is None:
        pytest.skip("the C++ kernel serves CPU engines")
    gen = torch.Generator().manual_seed(7)
    nkv, g, hd, slots, reqs, ctx = 3, 3, 64, 900, 4, 200
    k_cache = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    v_cache = torch.randn(slots, nkv, hd, generator=gen).to(dtype)
    table = torch.randperm(slots, generator=gen)[: reqs * ctx].view(reqs, ctx)
    blocks = [(2, 150, 4), (0, 37, 1), (3, 0, 3), (1, 90, 20), (2, 10, 2)]  # (request, prefix, tokens)
    rows = torch.tensor([r for r, _, n in blocks for _ in range(n)])
    seq_lens = torch.tensor([p + j + 1 for _, p, n in blocks for j in range(n)])
    seq_lens[5] = 0  # an empty row inside a run
    q = torch.randn(len(rows), nkv * g, hd, generator=gen).to(dtype)
    got = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, hd**-0.5, ctx)
    want = per_row(q, k_cache, v_cache, table, rows, seq_lens, hd**-0.5, dot_path(q, k_cache))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for i in range(len(rows)):
        alone = decode_attention(q[i : i + 1], k_cache, v_cache, table, rows[i : i + 1], seq_lens[i : i + 1],
                                 hd**-0.5, ctx)
        assert torch.equal(alone, got[i : i + 1]), i
    empty = decode_attention(q[:0], k_cache, v_cache, table, rows[:0], seq_lens[:0], hd**-0.5, ctx)
    assert empty.shape == (0, nkv * g, hd)


def test_rows_past_the_slot_table_are_refused():
    """A row longer than its slot table's row (or a row index outside the table) is an error, never a read
    outside it."""
    if DEVICE.type != "cpu" or cpu_extension("decode_attention") is None:
        pytest.skip("the C++ kernel serves CPU engines")
    k_cache, v_cache = torch.randn(2, 40, 1, 16)
    table, q = torch.arange(40).view(2, 20), torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="seq_lens"):
        decode_attention(q, k_cache, v_cache, table, torch.tensor([1]), torch.tensor([21]), 0.25, 21)
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        decode_attention(q, k_cache, v_cache, table, torch.tensor([2]), torch.tensor([5]), 0.25, 5)


def test_forced_torch_backend_uses_the_reference(force_kernels):
    """SGLANG_DFLASH_KERNELS=torch routes to the torch reference (bit-identical to calling it)."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 50, 2, 16, generator=gen)
    table, rows, seq_lens = torch.arange(50).view(2, 25), torch.tensor([1, 0]), torch.tensor([25, 3])
    q = torch.randn(2, 4, 16, generator=gen)
    force_kernels("torch")
    got = decode_attention(q, k_cache, v_cache, table, rows, seq_lens, 0.25, 25)
    assert torch.equal(got, decode_attention_torch(q, k_cache, v_cache, table, rows, seq_lens, 0.25, 25))
