"""SGLang plugin: `--speculative-algorithm DFLASH` runs sglang_dflash's DFlash worker inside upstream SGLang.

SGLang loads `register` in every server process through the `sglang.srt.plugins` entry point `dflash`.
On CPU (where SGLang's own DFLASH refuses to start), or anywhere with `SGLANG_DFLASH_IMPL=sglang_dflash`,
the DFLASH name resolves to the algorithm registered here, whose worker is `DFlashSGLangWorker`.
"""

from __future__ import annotations

from sglang_dflash.integrations.sglang.routing import ALGORITHM, IMPL_ENV

__all__ = ["ALGORITHM", "IMPL_ENV", "register"]

_registered = False


def worker_class(server_args: object) -> type:
    """Worker factory for SpeculativeAlgorithm.register (imported lazily: it pulls in SGLang's runtime)."""
    from sglang_dflash.integrations.sglang.worker import DFlashSGLangWorker

    return DFlashSGLangWorker


def register() -> None:
    """Registers the algorithm, the DFLASH routing step and the hooks (once per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dflash.integrations.sglang.hooks import HOOKS
    from sglang_dflash.integrations.sglang.routing import DFlashSpecAlgo, route_dflash

    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=DFlashSpecAlgo)(worker_class)
    register_resolution_hook("handle_speculative_decoding")(route_dflash)
    for target, (hook, hook_type) in HOOKS.items():
        HookRegistry.register(target, hook, hook_type)
    _registered = True
