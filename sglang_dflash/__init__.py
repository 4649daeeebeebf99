"""sglang-dflash: lossless speculative decoding with DFlash block-diffusion drafters."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from sglang_dflash.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
