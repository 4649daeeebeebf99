"""CPU shims for upstream SGLang: helpers that make its CPU engine import and run without AMX kernels.

Importing this package is cheap (no torch import); the work happens lazily in
:mod:`sglang_cpu_shims.torchvision_ops` when torchvision is first imported.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
