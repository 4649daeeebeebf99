"""HookRegistry hooks into SGLang: decode preparation for our draft input, and chain verify on torch_native."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_dflash.integrations.sglang.routing import DFlashSpecAlgo

PREPARE_FOR_DECODE = "sglang.srt.speculative.spec_utils.spec_prepare_for_decode"
TORCH_NATIVE_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"


def prepare_for_decode(original: Callable[..., None], batch: Any) -> None:
    """SGLang routes plugin algorithms to EAGLE's preparation; our draft input reserves its own KV slots."""
    from sglang_dflash.integrations.sglang.draft_input import DFlashDraftInput

    if isinstance(batch.spec_info, DFlashDraftInput):
        batch.spec_info.prepare_for_decode(batch)
    else:
        original(batch)


def chain_verify_attention(
    original: Callable[..., torch.Tensor], backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    layer: Any, forward_batch: Any, *args: Any, **kwargs: Any,
) -> torch.Tensor:
    """torch_native's extend path reads extend_prefix_lens/extend_seq_lens, which TARGET_VERIFY leaves unset.
    For our verify, present the block as an extend of B tokens after the committed prefix: the backend's
    causal SDPA over prefix + block is exactly chain verification."""
    fb = forward_batch
    if not (
        fb.forward_mode.is_target_verify() and fb.extend_seq_lens is None
        and isinstance(fb.spec_algorithm, DFlashSpecAlgo)
    ):
        return original(backend, q, k, v, layer, fb, *args, **kwargs)
    saved = fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens
    prefix = fb.seq_lens
    fb.extend_prefix_lens = prefix
    fb.extend_seq_lens = torch.full_like(prefix, fb.spec_info.draft_token_num)
    fb.seq_lens = prefix + fb.spec_info.draft_token_num
    try:
        return original(backend, q, k, v, layer, fb, *args, **kwargs)
    finally:
        fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens = saved


HOOKS: dict[str, tuple[Callable[..., Any], HookType]] = {
    PREPARE_FOR_DECODE: (prepare_for_decode, HookType.AROUND),
    TORCH_NATIVE_EXTEND: (chain_verify_attention, HookType.AROUND),
}


def missing_hooks() -> list[str]:
    """Targets whose hooks SGLang did not apply (it only logs failures)."""
    return [target for target in HOOKS if target not in HookRegistry._patched]
