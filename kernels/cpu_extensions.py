"""C++ CPU kernels (`csrc/*.cpp`), built on first use with the compiler torch extensions use (and cached by
torch); `scripts/setup.sh` builds them once. A kernel that cannot be built here is None: callers fall back to
torch, with a warning."""

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from sglang_dflash.kernels.backend import forced_backend

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
NAMES = ("argmax", "decode_attention", "draft_kv", "linear_bf16", "rms_norm", "rope")


def cpu_kernel(name: str):
    """The built extension `csrc/{name}.cpp` for CPU tensors, or None: not built here, or `SGLANG_DFLASH_KERNELS`
    forces a backend (torch, or Triton under its interpreter)."""
    return None if forced_backend() else cpu_extension(name)


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel source: timings measured with other kernels (cached cost models) are stale."""
    return hashlib.sha256(b"".join((CSRC / f"{name}.cpp").read_bytes() for name in NAMES)).hexdigest()[:8]


@functools.cache
def cpu_extension(name: str):
    """The built extension `csrc/{name}.cpp`, or None when it cannot be built here."""
    from torch.utils.cpp_extension import get_default_build_root, load

    # one build per torch install and source text, wherever the checkout is: the source is compiled from a copy
    # in the build directory, so two checkouts (CI's GPU-check dry run copies the tree) never rebuild each other's
    # (ninja rebuilds whenever the source path changes); environments (SGLang's venv) neither
    source = (CSRC / f"{name}.cpp").read_bytes()
    digest = hashlib.sha256(f"{torch.__version__} {torch.__file__}".encode() + source).hexdigest()[:8]
    build = Path(get_default_build_root()) / f"sglang_dflash_{name}_{digest}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        copy = build / f"{name}.cpp"
        if not copy.is_file() or copy.read_bytes() != source:
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(source)
            tmp.replace(copy)
        return load(build.name, [str(copy)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], extra_ldflags=["-lmvec"])
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("CPU kernel %s unavailable, using torch: %s", name, exc)
        return None
