"""Argmax (`kernels.argmax`): the float32 / bfloat16 CPU kernel against torch's argmax on fresh random rows of odd
sizes, ties, NaN / +-inf entries, all -inf rows, non-contiguous and 1-D / 3-D inputs; other dtypes stay on torch."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.kernels.argmax import argmax
from sglang_dflash.kernels.cpu_extensions import cpu_extension


def kernel_or_skip():
    if cpu_extension("argmax") is None:
        pytest.skip("the C++ kernel did not build here")


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 49152), (16, 8192), (3, 1), (5, 63), (33, 577), (2, 3, 130), (77,)])
def test_matches_torch(shape: tuple, dtype: torch.dtype):
    """Against torch's argmax of the float32 values (a bf16 value converts exactly; bf16 rows hold many ties)."""
    kernel_or_skip()
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
    assert torch.equal(got, x.float().argmax(-1))
    ties = (x * 2).round()  # many equal maxima: the first one wins
    assert torch.equal(argmax(ties), ties.float().argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_and_non_contiguous_rows(dtype: torch.dtype):
    kernel_or_skip()
    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        rows, n = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 400, (1,), generator=gen))
        x = torch.randn(rows, n, generator=gen).to(dtype)
        for value in (float("nan"), float("inf"), float("-inf")):
            hits = torch.randint(0, rows * n, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen)
            x.view(-1)[hits] = value
        x[trial % rows] = float("-inf") if trial % 5 == 0 else x[trial % rows]
        assert torch.equal(argmax(x), x.float().argmax(-1)), x
        strided = torch.randn(n, rows, generator=gen).to(dtype).t()  # columns of a matrix
        assert torch.equal(argmax(strided), strided.float().argmax(-1))
        every_other = torch.randn(rows, 2 * n, generator=gen).to(dtype)[:, ::2]
        assert torch.equal(argmax(every_other), every_other.float().argmax(-1))


def test_other_dtypes_use_torch():
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    assert torch.equal(argmax(x.double()), x.double().argmax(-1))
    assert torch.equal(argmax(x.half()), x.half().argmax(-1))
