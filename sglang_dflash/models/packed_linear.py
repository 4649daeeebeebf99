"""Linear layers with weights pre-packed for CPU GEMMs. bfloat16 on CPUs with AVX512-BF16: our kernel
(`kernels/csrc/linear_bf16.cpp`); measured over one model's worth of SmolLM2 layer weights (212 MB, streamed from
memory) on a 2-core avx512_bf16 AMD EPYC, against oneDNN's packed bf16 GEMM: M = 1 8.4 vs 19.4 ms (25 vs 11
GB/s), M = 4 8.5 vs 20.0, M = 16 19.6 vs 25.4, M = 64 46.6 vs 57.6, and no slower at M = 128-512. Otherwise
oneDNN: bfloat16 about 1.3-1.7x faster than plain torch at small batches on CPUs with native bf16; float32
1.8-2.2x faster than torch's default (MKL) GEMM on a 2-core AVX2 AMD EPYC (a [M, 576] x [576, 3072] GEMM: M = 1
630 vs 1377 us, M = 16 1405 vs 2544 us, M = 32 2092 vs 3689 us).

oneDNN lays the packed weight out for a batch size hint. float32 packs for 16 rows: packed for 1 row, a 2-row
GEMM took 1280 us against 699 (a speculative verify of 2 tokens cost 1.7x a decode step), and 1 row gained
nothing (753 vs 630 us). bfloat16 keeps the hint 1 it was measured with on a CPU with AMX.

On CPUs with AMX, oneDNN's bf16 GEMM runs on the tile unit and overtakes our kernel past a few rows (measured on a
2-core Xeon with AMX, one model's layer weights per call: M = 1 8.1 vs 12.4 ms, M = 8 10.9 vs 12.2, M = 12 17.0 vs
12.5, M = 16 20.1 vs 12.3, M = 32 38.2 vs 15.3; the lm head at M = 128 38.9 vs 4.4 ms). There both packs are
kept and a call takes ours up to ONEDNN_FROM_ROWS - 1 rows, oneDNN's from there. That makes a row's rounding
depend on its batch's size; `batch_invariant` keeps our kernel for every batch (--enable-deterministic-inference):
a row's output is then bit-identical whatever else is in the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.kernels.backend import forced_backend
from sglang_dflash.kernels.cpu_extensions import cpu_extension


def bf16_kernel():
    """The AVX512-BF16 linear kernel, or None where it is not built, the CPU lacks the instructions, or
    `SGLANG_DFLASH_KERNELS=torch` (oneDNN then)."""
    if forced_backend() == "torch":
        return None
    ext = cpu_extension("linear_bf16")
    return ext if ext is not None and ext.supported() else None


def has_amx() -> bool:
    """The CPU has AMX tiles (oneDNN's bf16 GEMM then runs on them)."""
    cpu = getattr(torch, "cpu", None)
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())


ONEDNN_FROM_ROWS = 10  # on AMX CPUs, see the module docstring


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing pays off (and is exercised by the tests) on CPUs for float32, and for bfloat16 where the
    CPU supports it natively."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for our bf16 kernel, in oneDNN's blocked layout, or both (AMX CPUs, see the module
    docstring). `keep_weight` keeps the plain `weight` too (for a tied or shared lm_head)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, batch_invariant: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernel = bf16_kernel() if weight.dtype == torch.bfloat16 else None
        self.packed = None if self.kernel is None else self.kernel.pack_weight(weight)
        # rows from which oneDNN's packed GEMM serves a call (0: always; None: never)
        self.onednn_from_rows = 0 if self.kernel is None else None
        if self.kernel is not None and has_amx() and not batch_invariant:
            self.onednn_from_rows = ONEDNN_FROM_ROWS
        self.onednn = None
        if self.onednn_from_rows is not None:
            hint = 16 if weight.dtype == torch.float32 else 1
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        self.bias = linear.bias
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # the oneDNN op has no autograd kernel
            if self.weight is None:
                raise RuntimeError("this PackedLinear is inference-only (built without keep_weight)")
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if self.onednn_from_rows is None or rows < self.onednn_from_rows:
            flat = x.reshape(-1, self.in_features).contiguous()
            y = self.kernel.linear_bf16(flat, self.packed, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")


def pack_linears(model: nn.Module, keep_weight: tuple[str, ...] = (), batch_invariant: bool = False) -> None:
    """Replaces every nn.Linear under `model` by a PackedLinear (keeping the plain weight of those named)."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear, keep_weight=name in keep_weight, batch_invariant=batch_invariant))
