"""DFlash 2 draft model: DFlash's layers with a grouped dynamic causal convolution around attention and around
the MLP, and a candidate selector that picks one path through the top-K tokens of every block position.

The context K/V path (fc -> hidden_norm -> k/v projections) is DFlash 1's, unconvolved, so the paged draft
KV cache, its just-in-time materialisation and the verify step are shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.models.dflash import (
    Attend,
    DFlashDraftModel,
    DraftLayer,
    checkpoint_dir,
    load_model_weights,
    randomise_,
)
from sglang_dflash.models.dflash_config import ARCHITECTURE, ARCHITECTURE2, DFlashConfig
from sglang_dflash.sampling.sampler import sample_from_probs

REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 0  # taps, reaching back at most to the block start
    conv_group_size: int = 0  # channels per group; one dynamic coefficient per group, tap and token
    selector_rank: int = 0
    selector_top_k: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    is_causal: bool | None = None  # None: the sliding-window layers are causal inside the block, the others not

    @classmethod
    def from_dict(cls, d: dict) -> DFlash2Config:
        archs = d.get("architectures") or []
        if ARCHITECTURE2 not in archs:
            raise ValueError(f"not a DFlash 2 draft config: architectures {archs}, expected [{ARCHITECTURE2!r}]")
        dc = d.get("dflash_config") or {}
        value = {k: dc.get(k, d.get(k)) for k in (*REQUIRED, *OPTIONAL)}
        missing = [k for k in REQUIRED if value[k] is None]
        if missing:
            raise ValueError(f"DFlash 2 config needs {missing} (in dflash_config)")
        base_dc = {k: v for k, v in dc.items() if k not in REQUIRED}
        base = {**d, "architectures": [ARCHITECTURE], "dflash_config": base_dc}
        rope = d.get("rope_parameters")  # transformers 5 writes rope_theta / rope_type here
        if rope and "rope_theta" not in d:
            base.update(rope_theta=rope["rope_theta"], rope_scaling=rope)
        base = DFlashConfig.from_dict(base)
        cfg = cls(
            **{f.name: getattr(base, f.name) for f in fields(DFlashConfig)},
            **{k: int(value[k]) for k in REQUIRED},
            **{k: default if value[k] is None else float(value[k]) for k, default in OPTIONAL.items()},
            is_causal=None if d.get("is_causal") is None else bool(d["is_causal"]),
        )
        cfg.raw = d
        cfg.check()
        return cfg

    @classmethod
    def extend(cls, base: DFlashConfig, taps: int, group: int, rank: int, top_k: int) -> DFlash2Config:
        """A DFlash 2 config with `base`'s layers (e.g. to warm-start from a DFlash 1 checkpoint)."""
        cfg = cls(**{f.name: getattr(base, f.name) for f in fields(DFlashConfig)}, conv_kernel_size=taps,
                  conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
        cfg.check()
        return cfg

    def check(self) -> None:
        if min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) < 1:
            raise ValueError("conv_kernel_size, conv_group_size, selector_rank and selector_top_k must be >= 1")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        vocab = self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)
        if self.selector_top_k > vocab:
            raise ValueError(f"selector_top_k {self.selector_top_k} exceeds the draft vocabulary ({vocab})")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["architectures"] = [ARCHITECTURE2]
        dc = d["dflash_config"]
        dc.update({k: getattr(self, k) for k in REQUIRED})
        for key, default in OPTIONAL.items():  # where the file had it, else in dflash_config when not the default
            value = getattr(self, key)
            if key in self.raw and key not in dc:
                d[key] = value
            elif key in dc or value != default:
                dc[key] = value
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        return d

    def layer_is_causal(self, layer_id: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types is not None and self.layer_types[layer_id] == "sliding_attention"


class GroupedDynamicCausalConv(nn.Module):
    """Convolutions before and after a sub-layer, along each block: out[t] = sum_o (base[o] + dyn[t, o]) x[t-o],
    base per channel, dyn per channel group from `kernel_projection` of the sub-layer's input at t; taps before
    the block start read zeros."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))  # [before / after, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor], block: int) -> torch.Tensor:
        """x [T, H] = T // block blocks of `block` tokens -> conv(sublayer(conv(x)))."""
        dynamic = self.kernel_projection(x).view(-1, 2, self.taps, self.groups)
        return self.convolve(sublayer(self.convolve(x, dynamic[:, 0], 0, block)), dynamic[:, 1], 1, block)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, which: int, block: int) -> torch.Tensor:
        xb = x.view(-1, block, self.groups, x.shape[-1] // self.groups)
        base = self.base_kernel[which].view(self.taps, self.groups, -1).to(x.dtype)
        dynamic = dynamic.reshape(-1, block, self.taps, self.groups, 1)
        out = torch.zeros_like(xb)
        for o in range(min(self.taps, block)):
            shifted = xb if o == 0 else F.pad(xb[:, :-o], (0, 0, 0, 0, o, 0))
            out = out + base[o] * shifted + dynamic[:, :, o] * shifted
        return out.view_as(x)


class DFlash2Layer(DraftLayer):
    def __init__(self, cfg: DFlash2Config, layer_id: int):
        super().__init__(cfg, layer_id)
        self.self_attn.causal = cfg.layer_is_causal(layer_id)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attend: Attend) -> torch.Tensor:
        h = h + self.attention_conv(self.input_layernorm(h), lambda x: self.self_attn(x, rope, attend), attend.block)
        return h + self.mlp_conv(self.post_attention_layernorm(h), self.mlp, attend.block)


class CandidateSelector(nn.Module):
    """Walks a block left to right from its anchor (the bonus): position i scores its top-K candidates c by
    unary logit + <pred[prev] * P h_i, succ[c]> and takes the argmax (greedy) or a sample of softmax(score / T)."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def scores(self, h: torch.Tensor, prev: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Scores [n, K] of candidates ids [n, K] (unary logits [n, K]) after token prev [n]; h [n, r] projected."""
        pair = torch.einsum("nr,nkr->nk", self.predecessor_codebook[prev] * h, self.successor_codebook[ids])
        return unary + pair.float()

    def teacher_forced_scores(
        self, x: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor
    ) -> torch.Tensor:
        """Scores [n, L, K] of candidates ids / unary logits [n, L, K] of normed states x [n, L, H] when
        position i follows the given token prev[:, i] (training; teacher-forced evaluation, where it equals
        `select`'s greedy path for as long as that path follows prev)."""
        n, length, k = ids.shape
        h = self.hidden_projection(x).flatten(0, 1)
        return self.scores(h, prev.flatten(), unary.flatten(0, 1), ids.flatten(0, 1)).view(n, length, k)

    def select(
        self, x: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
        temperatures: torch.Tensor | None, uniforms: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [n, L, H] normed states, candidates ids / unary logits [n, L, K] -> (path [n, L], q [n, L, K] the
        distribution each path token was drawn from, or None when greedy). temperatures [n] (0: greedy row) and
        uniforms [n, L] sample the path."""
        h = self.hidden_projection(x)
        prev, path, qs = anchors, [], []
        for i in range(x.shape[1]):
            scores = self.scores(h[:, i], prev, unary[:, i], ids[:, i])
            if temperatures is None:
                pick = scores.argmax(-1)
            else:
                greedy = temperatures[:, None] == 0
                q = torch.softmax(scores / torch.where(greedy, 1.0, temperatures[:, None]), -1)
                q = torch.where(greedy, F.one_hot(scores.argmax(-1), q.shape[-1]).to(q.dtype), q)
                pick = sample_from_probs(q, uniforms[:, i])
                qs.append(q)
            prev = ids[:, i].gather(1, pick[:, None]).squeeze(1)
            path.append(prev)
        return torch.stack(path, 1), torch.stack(qs, 1) if qs else None


class DFlash2DraftModel(DFlashDraftModel):
    """Trainable parts: DFlash's, plus each layer's attention_conv / mlp_conv and the candidate_selector."""

    layer_class = DFlash2Layer
    samples_paths = True

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.input_embedding_scale

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def teacher_forced_drafts(self, x: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The selector's greedy pick among each row's top-K given the gold predecessor."""
        selector = self.candidate_selector
        unary, top = logits.topk(selector.top_k, dim=-1)
        scores = selector.teacher_forced_scores(x, unary, self.map_draft_tokens(top), prev)
        return top.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)

    def propose(
        self, hidden: torch.Tensor, anchors: torch.Tensor, temperatures: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The selector's path [n, L] through the top-K of block rows 1.. (hidden [n, L, H], anchors [n] the
        bonus tokens); with temperatures [n] (0: greedy) and uniforms [n, L] a sampled path and its sparse draft
        distributions (candidate ids, q), each [n, L, K]."""
        x = self.norm(hidden)
        unary, top = self.head_logits(x).topk(self.candidate_selector.top_k, dim=-1)
        ids = self.map_draft_tokens(top)
        path, q = self.candidate_selector.select(x, unary, ids, anchors, temperatures, uniforms)
        return path, None if q is None else (ids, q)


def load_dflash2_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> DFlash2DraftModel:
    """Reads a DFlash 2 checkpoint directory (config.json + model.safetensors)."""
    path = checkpoint_dir(path)
    return load_model_weights(DFlash2DraftModel, DFlash2Config.load(path), path, device, dtype)


def dflash1_equivalent_(model: DFlash2DraftModel) -> DFlash2DraftModel:
    """In place: the DFlash 2 additions silent (every convolution the identity: tap 0 = 1, no dynamic part; no
    selector pair term), so the draft proposes what DFlash 1 with the same shared weights proposes. Training
    from here still moves them: the zeroed projections receive gradients through the codebooks and taps."""
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        model.candidate_selector.hidden_projection.weight.zero_()
    return model


def random_dflash2_model(cfg: DFlash2Config, seed: int = 0, std: float = 0.02) -> DFlash2DraftModel:
    """A random DFlash 2 draft (float32, cpu): `random_draft_model`'s weights, convolutions near the identity
    (tap 0 = 1, random dynamic part)."""
    model = randomise_(DFlash2DraftModel(cfg), seed, std)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] = 1.0
    return model
