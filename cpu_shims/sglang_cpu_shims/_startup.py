"""Executed at interpreter start by ``sglang_cpu_shims.pth``: arm the torchvision fix.

Every Python process of the venv (SGLang spawns three) runs the .pth line, so
this must stay cheap: it only puts a finder on ``sys.meta_path``. The finder
fires once, on the first ``import torchvision`` (or any submodule), defines the
missing op schemas, removes itself and lets the normal import proceed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

DISABLE_ENV = "SGLANG_CPU_SHIMS_NO_TORCHVISION_FIX"


class TorchvisionSchemaFinder(MetaPathFinder):
    """One-shot finder that runs :func:`define_torchvision_schemas` before torchvision loads."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        disarm()
        from sglang_cpu_shims.torchvision_ops import define_torchvision_schemas

        define_torchvision_schemas()
        return None  # let the regular finders import torchvision


def disarm() -> None:
    """Remove every instance of the finder from ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchvisionSchemaFinder)]


def arm() -> None:
    """Install the finder unless disabled, already installed, or torchvision is already imported."""
    if os.environ.get(DISABLE_ENV) == "1" or "torchvision" in sys.modules:
        return
    if any(isinstance(f, TorchvisionSchemaFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, TorchvisionSchemaFinder())


arm()
