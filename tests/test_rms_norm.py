"""RMSNorm (`kernels.rms_norm`): the bf16 CPU kernel against torch's F.rms_norm on random rows of odd sizes and
non-contiguous inputs, each row independent of its batch; float32 and autograd stay on torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.kernels.cpu_extensions import cpu_extension
from sglang_dflash.kernels.rms_norm import rms_norm


def kernel_or_skip():
    if cpu_extension("rms_norm") is None:
        pytest.skip("the C++ kernel did not build here")


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (33, 577), (130, 960), (2, 5, 576)])
def test_bf16_matches_torch(shape: tuple):
    kernel_or_skip()
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 4).bfloat16()
    w = (torch.rand(shape[-1], generator=gen) * 2).bfloat16()
    got, ref = rms_norm(x, w, 1e-5), F.rms_norm(x, w.shape, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # the sum of squares may round differently from torch's: at most one bf16 step on a few elements
    torch.testing.assert_close(got.float(), ref.float(), atol=0, rtol=2**-7)
    assert (got != ref).float().mean() < 0.01


def test_non_contiguous_rows_and_batch_invariance():
    kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 2 * 576, generator=gen).bfloat16()[:, ::2]  # non-contiguous
    w = torch.rand(576, generator=gen).bfloat16()
    got = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.float(), F.rms_norm(x, w.shape, w, 1e-6).float(), atol=0, rtol=2**-7)
    for i in (0, 17, 39):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-6), got[i : i + 1]), i


def test_float32_and_autograd_use_torch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=gen)
    w = torch.rand(96, generator=gen)
    assert torch.equal(rms_norm(x, w, 1e-5), F.rms_norm(x, w.shape, w, 1e-5))
    xb = x.bfloat16().requires_grad_()
    out = rms_norm(xb, w.bfloat16(), 1e-5)
    out.float().sum().backward()
    assert xb.grad is not None and torch.equal(out.detach(), F.rms_norm(xb.detach(), (96,), w.bfloat16(), 1e-5))
