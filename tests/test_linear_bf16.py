"""The AVX512-BF16 linear kernel (`kernels/csrc/linear_bf16.cpp`) through `PackedLinear`, against a float64
linear on random weights: odd shapes (K not even, N not a multiple of 16), with and without bias, 1-130 rows,
non-contiguous and 3-d inputs, with the batch-invariant dispatch and the default one. Skipped on CPUs without
AVX512-BF16 (oneDNN packs there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_dflash.models import packed_linear
from sglang_dflash.models.packed_linear import PackedLinear, bf16_kernel

pytestmark = pytest.mark.skipif(bf16_kernel() is None, reason="no AVX512-BF16 kernel on this CPU")


@pytest.mark.parametrize("shape", [(96, 160), (97, 35), (576, 1536), (1536, 576), (64, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_matches_float64_linear(shape: tuple[int, int], bias: bool, batch_invariant: bool, monkeypatch):
    """Both dispatches: batch-invariant, and AMX's (batches of ONEDNN_FROM_ROWS rows and more to oneDNN; forced here
    on CPUs without AMX too, where oneDNN's bf16 GEMM runs on AVX512-BF16)."""
    monkeypatch.setattr(packed_linear, "has_amx", lambda: True)
    k, n = shape
    gen = torch.Generator().manual_seed(k * n)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    lin = lin.bfloat16()
    packed = PackedLinear(lin, batch_invariant=batch_invariant)
    assert packed.kernel is not None and (packed.onednn is None) == batch_invariant
    for m in (1, 2, 7, 8, 9, 16, 17, 33, 130):
        x = torch.randn(m, 2 * k, generator=gen).bfloat16()[:, ::2]  # non-contiguous rows
        ref = nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # float32 accumulation, one bf16 rounding of the output (2^-8 relative) and summation order
        torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-3 * ref.abs().max().item())
    x3 = torch.randn(2, 3, k, generator=gen).bfloat16()
    assert torch.equal(packed(x3), packed(x3.reshape(6, k)).view(2, 3, n))


def test_a_row_does_not_depend_on_its_batch():
    """Rows split evenly over the passes of a weight block (33 rows: 7 7 7 6 6); each row's sums run in the same
    order whatever the batch, so its output is bit-identical alone or among others (batch_invariant: our kernel
    for every batch size)."""
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(576, 200, bias=False).bfloat16()
    packed = PackedLinear(lin, batch_invariant=True)
    x = torch.randn(41, 576, generator=gen).bfloat16()
    whole = packed(x)
    for rows in (slice(0, 1), slice(0, 9), slice(0, 17), slice(0, 33), slice(5, 6), slice(3, 36)):
        assert torch.equal(packed(x[rows]), whole[rows])
