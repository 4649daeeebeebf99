"""Training checkpoints: the drafter in the public format next to `train_state.pt`, which resumes a run
exactly (optimizer, RNG states, data order, history).

`fc` trains on features divided by their per-dimension RMS (the feature scale); the public checkpoint's
fc.weight acts on raw features, so the scale is folded in on save and multiplied back in on load."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from sglang_dflash.models.dflash import DFlashDraftModel
from sglang_dflash.models.dflash2 import DFlash2Config
from sglang_dflash.models.dflash_config import DFlashConfig

if TYPE_CHECKING:
    from sglang_dflash.training.trainer import DFlashTrainer


def write_drafter(draft: DFlashDraftModel, feature_scale: torch.Tensor, path: Path) -> None:
    """config.json + model.safetensors, with fc.weight acting on raw features."""
    folded = (draft.fc.weight / feature_scale[None, :]).detach()
    draft.save_pretrained(path, overrides={"fc.weight": folded})


def load_drafter(draft: DFlashDraftModel, feature_scale: torch.Tensor, path: Path) -> None:
    """Loads a public-format checkpoint into a draft that trains on scaled features (write_drafter's inverse).
    A DFlash 1 checkpoint loads into a DFlash 2 draft too: its additions keep their current (silent) weights."""
    device = feature_scale.device
    weights = load_file(str(path / "model.safetensors"), device=str(device))
    if isinstance(draft.config, DFlash2Config) and not isinstance(DFlashConfig.load(path), DFlash2Config):
        weights = {**draft.trainable_state_dict(), **weights}
    draft.load_weights(weights)
    with torch.no_grad():
        draft.fc.weight.mul_(feature_scale[None, :])
    draft.prepare_inference(device)


def save_checkpoint(trainer: DFlashTrainer, path: Path) -> None:
    write_drafter(trainer.draft, trainer.feature_scale, path)
    if trainer.features.cache is not None:
        trainer.features.cache.flush()
    state = {"step": trainer.step, "opt": trainer.opt.state_dict(), "gen": trainer.gen.get_state(),
             "fc_weight": trainer.draft.fc.weight.detach().cpu(), "feature_scale": trainer.feature_scale.cpu(),
             "torch_rng": torch.get_rng_state(), "history": trainer.history, "tokens_seen": trainer.tokens_seen,
             **trainer.data.state_dict(), "config": asdict(trainer.cfg)}
    torch.save(state, path / "train_state.pt")


def load_checkpoint(trainer: DFlashTrainer, path: Path) -> None:
    """Restores what save_checkpoint wrote into a trainer built with the checkpoint's draft config."""
    state = torch.load(path / "train_state.pt", weights_only=False)
    trainer.draft.load_weights(load_file(str(path / "model.safetensors"), device=str(trainer.device)))
    trainer.feature_scale = state["feature_scale"].to(trainer.device)
    with torch.no_grad():  # the exact trained weight (the file has the scale folded in)
        trainer.draft.fc.weight.copy_(state["fc_weight"])
    trainer.draft.prepare_inference(trainer.device)
    trainer.opt.load_state_dict(state["opt"])
    trainer.gen.set_state(state["gen"])
    torch.set_rng_state(state["torch_rng"])
    trainer.step, trainer.history, trainer.tokens_seen = state["step"], state["history"], state["tokens_seen"]
    trainer.data.load_state_dict(state)
