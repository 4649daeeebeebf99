"""Drafter set-up shared by both hosts: checkpoint path, block size, loading and binding to the target."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sglang_dflash.models.dflash import DFlashDraftModel, checkpoint_dir, load_draft_model
from sglang_dflash.models.dflash2 import DFlash2Config, load_dflash2_model
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.models.packed_linear import PackedLinear, can_pack, pack_linears

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTER = DRAFTERS_DIR / "smollm2-135m-instruct-dflash"


def default_drafter_path(model_path: str | None) -> Path:
    """The drafter shipped for the default target model."""
    from sglang_dflash.models.default_model import default_model_path

    is_default = model_path is None or Path(model_path).resolve() == default_model_path().resolve()
    if not is_default:
        raise ValueError("speculative_algorithm='DFLASH' needs speculative_draft_model_path for this target model")
    if not (DEFAULT_DRAFTER / "model.safetensors").is_file():
        raise ValueError(
            f"no default DFlash drafter is installed ({DEFAULT_DRAFTER}); pass speculative_draft_model_path"
        )
    return DEFAULT_DRAFTER


def merge_block_flags(num_draft_tokens: int | None, dflash_block_size: int | None) -> int | None:
    """--speculative-num-draft-tokens and its alias --speculative-dflash-block-size: they must agree."""
    a, b = num_draft_tokens, dflash_block_size
    if a is not None and b is not None and int(a) != int(b):
        raise ValueError(f"speculative_num_draft_tokens ({a}) and speculative_dflash_block_size ({b}) disagree")
    n = a if a is not None else b
    if n is not None and int(n) < 1:
        raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {n}")
    return None if n is None else int(n)


def resolve_block_size(requested: int | None, drafter_block: int) -> int:
    """The block size B: the requested one (at most the drafter's), else the drafter's."""
    size = drafter_block if requested is None else requested
    if not 1 <= size <= drafter_block:
        raise ValueError(f"speculative_num_draft_tokens={size} must be in [1, {drafter_block}] for this drafter")
    return size


def load_drafter(
    path: str | Path, device: torch.device, dtype: torch.dtype, target_config, embed_tokens: nn.Module,
    lm_head: nn.Module, batch_invariant: bool = False,
) -> DFlashDraftModel:
    """Loads a DFlash checkpoint (DFlash 1 or 2, as its config's `architectures` says), checks it against the
    target and binds the target's embedding and head."""
    dflash2 = isinstance(DFlashConfig.load(checkpoint_dir(path)), DFlash2Config)
    load = load_dflash2_model if dflash2 else load_draft_model
    draft = load(path, device, dtype)
    draft.config.check_target(target_config)
    draft.bind_target(embed_tokens, lm_head)
    draft.prepare_inference(device)
    if can_pack(device, dtype):  # packed bf16 GEMMs on CPU, as the target's
        pack_linears(draft, keep_weight=("fc",), batch_invariant=batch_invariant)
        object.__setattr__(draft, "kv_proj", PackedLinear(draft.kv_proj, batch_invariant=batch_invariant))
        if draft.draft_head is not None:
            object.__setattr__(draft, "draft_head", PackedLinear(draft.draft_head, batch_invariant=batch_invariant))
    return draft
