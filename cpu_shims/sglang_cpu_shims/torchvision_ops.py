"""Define the ``torchvision::nms``/``qnms`` schemas so a CUDA torchvision wheel imports under CPU torch.

PyPI ships only CUDA builds of torchvision. Under a CPU build of torch its
``_C`` extension fails to load, and ``torchvision._meta_registrations`` then
registers fake kernels for ops that do not exist, which raises at import.
Defining the two schemas (no kernels) through a ``torch.library`` fragment
first is enough for ``import torchvision`` to succeed; calling the ops still
fails, which SGLang never does for text models.
"""

from __future__ import annotations

import sys
from importlib import metadata

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

# Keep the Library alive: registrations are dropped when it is garbage collected.
_LIBRARY: object | None = None


def _needs_fix() -> bool:
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return False  # a GPU torch loads torchvision's own extension
    try:
        tv_version = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return False
    # A "+cpu" build from the PyTorch index ships a loadable extension that defines these ops itself.
    return "+cpu" not in tv_version


def _op_defined(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def define_torchvision_schemas() -> bool:
    """Define the missing schemas once; return True when something was defined."""
    global _LIBRARY
    if _LIBRARY is not None:
        return False
    try:
        if not _needs_fix():
            return False
        import torch.library

        missing = [name for name in _SCHEMAS if not _op_defined(name)]
        if not missing:
            return False
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(_SCHEMAS[name])
        _LIBRARY = lib
        return True
    except Exception as exc:  # never break an unrelated import at startup
        print(f"sglang_cpu_shims: torchvision schema fix failed: {exc!r}", file=sys.stderr)
        return False
