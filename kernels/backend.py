"""Kernel backend selection: Triton on cuda/xpu tensors when importable, torch otherwise.

`SGLANG_DFLASH_KERNELS=torch|triton` forces one backend (Triton on CPU tensors needs
`TRITON_INTERPRET=1`).
"""

import functools
import importlib
import os

import torch

ENV_VAR = "SGLANG_DFLASH_KERNELS"
# rejection sampling in fixed point (identical draws in torch and Triton): probabilities x 2^32, 24-bit uniforms
PROB_SCALE = 2.0**32
UNIFORM_BITS = 24
_TRITON_DEVICES = ("cuda", "xpu")


@functools.cache
def triton_import_error() -> str | None:
    """None when triton imports, otherwise the import error text."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:  # triton is an optional dependency
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    return triton_import_error() is None


@functools.cache
def forced_backend() -> str:
    """`SGLANG_DFLASH_KERNELS`, read once per process ("" when unset; every kernel call asks, so it is cached:
    whoever changes the variable at run time, as the tests do, calls `forced_backend.cache_clear()`)."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced not in ("", "torch", "triton"):
        raise ValueError(f"{ENV_VAR} must be 'torch' or 'triton', got {forced!r}")
    return forced


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether kernels called on `tensor` should run the Triton implementation."""
    forced = forced_backend()
    if forced == "torch":
        return False
    if forced == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but triton is unavailable ({triton_import_error()})")
        return True
    return tensor.device.type in _TRITON_DEVICES and triton_available()


def strides(*tensors: torch.Tensor) -> list[int]:
    """Every stride of each tensor, in order: the stride arguments of the Triton kernels."""
    return [s for t in tensors for s in t.stride()]
