"""C++ CPU kernels (`csrc/*.cpp`), built on first use with the compiler torch extensions use (and cached by
torch); `scripts/setup.sh` builds them once. A kernel that cannot be built here is None: callers fall back to
torch, with a warning."""

import functools
import hashlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
NAMES = ("decode_attention", "linear_bf16")


@functools.cache
def cpu_extension(name: str):
    """The built extension `csrc/{name}.cpp`, or None when it cannot be built here."""
    from torch.utils.cpp_extension import load

    # one build per torch install: environments (e.g. SGLang's venv) must not rebuild each other's
    install = hashlib.sha256(f"{torch.__version__} {torch.__file__}".encode()).hexdigest()[:8]
    try:
        return load(f"sglang_dflash_{name}_{install}", [str(CSRC / f"{name}.cpp")],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], extra_ldflags=["-lmvec"])
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("CPU kernel %s unavailable, using torch: %s", name, exc)
        return None
