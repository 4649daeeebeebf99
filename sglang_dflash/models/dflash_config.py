"""DFlashConfig: the public DFlash draft checkpoint config (config.json), read and written faithfully."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sglang_dflash.models.config import ModelConfig

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"  # its config: sglang_dflash.models.dflash2.DFlash2Config


def default_target_layer_ids(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """Spread from shallow to deep: [L // 2] for one layer, else round(1 + i*(L-4)/(n-1))."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    draft_vocab: list[int] | None = None  # extension: rows of the target lm_head the draft may propose
    raw: dict = field(default_factory=dict)  # the whole config.json, so unknown keys round-trip

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        archs = d.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(f"not a DFlash draft config: architectures {archs}, expected [{ARCHITECTURE!r}]")
        dc = d.get("dflash_config") or {}
        for key in ("conv_kernel_size", "selector_rank"):
            if dc.get(key):
                raise ValueError(f"{key} in dflash_config: a DFlash2 config needs architectures [{ARCHITECTURE2!r}]")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        scaling = d.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling} is not supported by the draft model yet")
        heads = d["num_attention_heads"]
        block = dc.get("block_size", d.get("block_size"))
        n_target = dc.get("num_target_layers", d.get("num_target_layers"))
        layer_ids = dc.get("target_layer_ids")
        if block is None or n_target is None or layer_ids is None or "mask_token_id" not in dc:
            raise ValueError("DFlash config needs block_size, num_target_layers, dflash_config.target_layer_ids "
                             "and dflash_config.mask_token_id")
        return cls(
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta", 1e4)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            vocab_size=d["vocab_size"],
            block_size=int(block),
            num_target_layers=int(n_target),
            target_layer_ids=list(layer_ids),
            mask_token_id=int(dc["mask_token_id"]),
            attention_bias=bool(d.get("attention_bias", False)),
            rope_scaling=scaling,
            layer_types=d.get("layer_types"),
            sliding_window=d.get("sliding_window"),
            draft_vocab=dc.get("draft_vocab"),
            raw=d,
        )

    @classmethod
    def load(cls, path: str | Path) -> DFlashConfig:
        """The checkpoint's config; `DFlashConfig.load` of a DFlash 2 checkpoint gives its `DFlash2Config`."""
        d = json.loads((Path(path) / "config.json").read_text())
        if cls is DFlashConfig and ARCHITECTURE2 in (d.get("architectures") or []):
            from sglang_dflash.models.dflash2 import DFlash2Config  # dflash2 builds on this module

            return DFlash2Config.from_dict(d)
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        d = dict(self.raw)
        dc = dict(d.get("dflash_config") or {})
        d.update(
            architectures=[ARCHITECTURE], model_type=d.get("model_type", "qwen3"), hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            attention_bias=self.attention_bias, block_size=self.block_size, num_target_layers=self.num_target_layers,
        )
        if self.layer_types is not None:
            d["layer_types"] = self.layer_types
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        dc.update(target_layer_ids=self.target_layer_ids, mask_token_id=self.mask_token_id,
                  block_size=self.block_size, num_target_layers=self.num_target_layers)
        if self.draft_vocab is not None:
            dc["draft_vocab"] = self.draft_vocab
        d["dflash_config"] = dc
        return d

    @classmethod
    def for_target(
        cls, target: ModelConfig, num_layers: int, block_size: int, mask_token_id: int,
        intermediate_size: int | None = None,
    ) -> DFlashConfig:
        """A draft shaped like the target's layers (the usual recipe), num_layers deep."""
        return cls(
            hidden_size=target.hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, intermediate_size=intermediate_size or target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
            block_size=block_size, num_target_layers=target.num_hidden_layers,
            target_layer_ids=default_target_layer_ids(num_layers, target.num_hidden_layers),
            mask_token_id=mask_token_id,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Fails with a message naming the mismatch when this draft cannot serve the target."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"draft hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} out of range for a target with {target.num_hidden_layers} layers"
            )
        if any(b <= a for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be strictly increasing")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the target vocab ({target.vocab_size})")
