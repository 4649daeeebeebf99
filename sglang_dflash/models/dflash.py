"""DFlash draft model: a few decoder layers that denoise a block [bonus, MASK, ...] in one
non-causal pass, with the target's projected hidden features injected as extra K/V in every layer.

Embedding and lm_head are the target's (held by reference, frozen). The context K/V of committed
tokens is materialised just in time into the draft's paged pool by `materialize_context_kv`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_dflash.kernels import materialize_draft_kv
from sglang_dflash.kernels.argmax import argmax
from sglang_dflash.kernels.decode_attention import decode_attention, reads_runs
from sglang_dflash.kernels.draft_kv import block_kv_kernel
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.models.llama import MLP, RMSNorm
from sglang_dflash.models.rotary import apply_rope, build_cos_sin_cache, rope_at, rope_table

Attend = Callable[["DraftAttention", torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
"""attend(attn, q [T, nH, hd], k [T, nKV, hd], v [T, nKV, hd]) -> o [T, nH, hd]: the attention of the block
tokens over the keys of their context and of their own block (inference: `PagedBlockAttention`; training:
`sglang_dflash.training.block_attention.AnchorBlockAttention`). Both carry `block`, the width of the blocks
the T tokens form, `project(attn, x, rope) -> (q, k, v)`, the layer's normed and rotated projections of the
block tokens x (`DraftAttention.project_qkv`; PagedBlockAttention writes k and v into the pool there and may
return None for them), and `uses_rope`: whether `project` needs the layers' rope (else it is None)."""


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int, sliding_window: int | None):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.sliding_window = sliding_window
        self.causal = False  # causal inside the block (DFlash 2 layers that ask for it)

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K = RoPE(k_norm(k_proj(x))), V = v_proj(x), each [T, nKV, hd] (block tokens or context features)."""
        k = apply_rope(self.k_norm(self.k_proj(x).view(-1, self.nkv, self.hd)), *rope)
        return k, self.v_proj(x).view(-1, self.nkv, self.hd)

    def project_qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q = RoPE(q_norm(q_proj(x))) [T, nH, hd], and `project_kv`."""
        q = apply_rope(self.q_norm(self.q_proj(x).view(-1, self.nh, self.hd)), *rope)
        return (q, *self.project_kv(x, rope))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attend: Attend) -> torch.Tensor:
        return self.o_proj(attend(self, *attend.project(self, x, rope)).reshape(-1, self.nh * self.hd))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_id: int):
        super().__init__()
        sliding = cfg.layer_types is not None and cfg.layer_types[layer_id] == "sliding_attention"
        self.self_attn = DraftAttention(cfg, layer_id, cfg.sliding_window if sliding else None)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attend: Attend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class PagedBlockAttention:
    """Inference keys: each request's committed context, then its own block (non-causal), read from the
    paged draft KV cache through `kv_indices`; the block's own K/V are written into its slots first, by `project`
    (they are rewritten by context K/V once committed; on CPU one C++ call normalises, rotates and writes them).
    Where the C++ decode-attention kernel serves (CPU), a block's tokens attend as rows of one run straight from the
    pool (each K/V row read once for the block); otherwise, and for causal or sliding-window layers (DFlash 2), SDPA
    over the gathered keys."""

    def __init__(
        self, positions: torch.Tensor, out_cache_loc: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
        block: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype,
    ):
        self.bs, self.block = kv_indices.shape[0], block
        self.positions, self.cos_sin_cache = positions, cos_sin_cache
        self.out_cache_loc, self.kv_indices, self.kv_lens = out_cache_loc, kv_indices, kv_lens
        self.k_buffer, self.v_buffer = k_buffer, v_buffer
        self.kv_kernel = block_kv_kernel(positions.device, dtype, k_buffer.dtype)  # None: torch projections
        self.uses_rope = self.kv_kernel is None
        self.runs = reads_runs(kv_indices.device)  # the C++ kernel: the block's rows attend as one run
        if self.runs:
            self.rows = torch.arange(self.bs, device=kv_indices.device).repeat_interleave(block)  # token -> request
            # as the mask: no key past kv_indices (an overlapped host's bound can lag the device's lengths)
            self.row_lens = kv_lens.clamp(max=kv_indices.shape[1]).repeat_interleave(block)

    def project(
        self, attn: DraftAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The block tokens' queries; their keys and values go into the pool (None returned where the kernel wrote
        them)."""
        k_buffer, v_buffer = self.k_buffer[attn.layer_id], self.v_buffer[attn.layer_id]
        if (kernel := self.kv_kernel) is not None:
            q = kernel(attn.q_proj(x).view(-1, attn.nh, attn.hd), attn.k_proj(x).view(-1, attn.nkv, attn.hd),
                       attn.v_proj(x).view(-1, attn.nkv, attn.hd), attn.q_norm.weight, attn.k_norm.weight,
                       self.positions, self.cos_sin_cache, self.cos_sin_cache.shape[1], attn.q_norm.eps, k_buffer,
                       v_buffer, self.out_cache_loc)
            return q, None, None
        q, k, v = attn.project_qkv(x, rope)
        k_buffer.index_copy_(0, self.out_cache_loc, k.to(k_buffer.dtype))
        v_buffer.index_copy_(0, self.out_cache_loc, v.to(v_buffer.dtype))
        return q, k, v

    def __call__(
        self, attn: DraftAttention, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """Reads the block's own K/V from the pool (`project` wrote them)."""
        k_buffer, v_buffer = self.k_buffer[attn.layer_id], self.v_buffer[attn.layer_id]
        if not attn.causal and attn.sliding_window is None and self.runs:
            o = decode_attention(q, k_buffer, v_buffer, self.kv_indices, self.rows, self.row_lens, attn.hd**-0.5,
                                 self.kv_indices.shape[1])
            return o.to(q.dtype)
        kv_pos = torch.arange(self.kv_indices.shape[1], device=q.device)
        mask = (kv_pos[None, :] < self.kv_lens[:, None])[:, None, :]  # [bs, 1, max_kv]
        offset = self.positions.view(self.bs, self.block)[:, :, None] - kv_pos[None, None, :]  # query - key position
        if attn.causal:
            mask = mask & (offset >= 0)
        if attn.sliding_window is not None:
            mask = mask & (offset < attn.sliding_window) & (-offset < attn.sliding_window)
        keys = k_buffer[self.kv_indices].transpose(1, 2)
        values = v_buffer[self.kv_indices].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(self.bs, self.block, attn.nh, attn.hd).transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
            attn_mask=mask[:, None], enable_gqa=attn.nkv != attn.nh,
        )
        return o.transpose(1, 2).reshape(self.bs * self.block, attn.nh, attn.hd)


def block_input_ids(first_tokens: torch.Tensor, block: int, mask_token_id: int) -> torch.Tensor:
    """The draft's block inputs [n, block]: row i = [first_tokens[i], MASK, ..., MASK]."""
    cols = torch.arange(block, device=first_tokens.device)
    return torch.where(cols[None, :] == 0, first_tokens[:, None], mask_token_id)


class DFlashDraftModel(nn.Module):
    """Trainable parts: layers, fc, hidden_norm, norm. `embed_tokens` / `lm_head` are the target's."""

    layer_class = DraftLayer
    samples_paths = False  # proposals are point masses (argmax); DFlash 2 samples its paths at T > 0

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None
        self.cos_sin_cache: torch.Tensor | None = None  # float32 cat(cos, sin), read by the fused KV kernel
        self.rope: torch.Tensor | None = None  # float32 rope_table: RoPE of the layers runs in float32
        self.kv_proj: nn.Module | None = None  # every layer's k_proj and v_proj stacked (not a parameter)
        self.k_norm_weight: torch.Tensor | None = None
        self.draft_vocab: torch.Tensor | None = None
        self.draft_head: nn.Module | None = None  # the draft vocabulary's rows of the target head (not a parameter)

    # ---- wiring ----
    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Shares the target's embedding and lm_head (references, never copies)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)

    def prepare_inference(self, device: torch.device) -> None:
        """Builds the rope cache and the layer-stacked context K/V weights (after weights are loaded)."""
        cfg = self.config
        self.cos_sin_cache = build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device)
        self.rope = rope_table(self.cos_sin_cache, torch.float32)
        attns = [layer.self_attn for layer in self.layers]
        weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)], 0).detach()
        kv_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=cfg.attention_bias, device="meta")
        kv_proj.weight = nn.Parameter(weight, requires_grad=False)
        if cfg.attention_bias:
            bias = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)], 0).detach()
            kv_proj.bias = nn.Parameter(bias, requires_grad=False)
        object.__setattr__(self, "kv_proj", kv_proj)
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns]).detach()
        if cfg.draft_vocab is not None:
            self.draft_vocab = torch.tensor(cfg.draft_vocab, dtype=torch.int64, device=device)
            if self.lm_head is not None:  # the draft vocabulary's rows of the (frozen) target head, gathered once
                head = nn.Linear(cfg.hidden_size, len(self.draft_vocab), bias=False, device="meta")
                head.weight = nn.Parameter(self.lm_head.weight[self.draft_vocab].detach(), requires_grad=False)
                object.__setattr__(self, "draft_head", head)

    # ---- context features -> draft KV ----
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target hidden states [N, K*H] -> ctx [N, H] = hidden_norm(fc(features))."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def materialize_context_kv(
        self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
        k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    ) -> None:
        """Writes every draft layer's context K/V (`DraftAttention.project_kv` of ctx) with ONE GEMM and the
        fused norm + RoPE kernel."""
        cfg = self.config
        kv = self.kv_proj(self.project_context(features))
        kv = kv.view(-1, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
        materialize_draft_kv(kv, self.k_norm_weight, positions, self.cos_sin_cache, cfg.head_dim, cfg.rms_norm_eps,
                             k_buffer, v_buffer, out_cache_loc)

    # ---- the block forward ----
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
        kv_indices: torch.Tensor, kv_lens: torch.Tensor, block: int, k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [bs*block, H] of padded blocks.

        input_ids/positions/out_cache_loc: [bs*block]; kv_indices [bs, max_kv] token slots of each
        request's context followed by its block; kv_lens [bs] = context + real block length.
        """
        h = self.embed(input_ids)
        attend = PagedBlockAttention(positions, out_cache_loc, kv_indices, kv_lens, block, k_buffer, v_buffer,
                                     self.cos_sin_cache, self.fc.weight.dtype)
        return self.run_layers(h, positions, attend)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Block token embeddings (the target's embedding) in the draft's dtype."""
        return self.embed_tokens(input_ids).to(self.fc.weight.dtype)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Block token states h [T, H] at `positions` [T] through every draft layer (before the final norm)."""
        rope = rope_at(self.rope, positions) if attend.uses_rope else None  # the C++ block kernel rotates itself
        for layer in self.layers:
            h = layer(h, rope, attend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target vocab (or the draft vocabulary subset, if the checkpoint has one)."""
        return self.head_logits(self.norm(hidden))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of normed states x."""
        if self.draft_vocab is None:
            return self.shape_logits(self.lm_head(x).float())
        if self.draft_head is not None:
            return self.shape_logits(self.draft_head(x).float())
        return self.shape_logits(F.linear(x, self.lm_head.weight[self.draft_vocab]).float())

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's raw logits as the draft scores them (DFlash 2: multiplier and soft-capping)."""
        return logits

    def map_draft_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.draft_vocab is None else self.draft_vocab[ids]

    def teacher_forced_drafts(self, x: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [n, L] (draft vocabulary ids) of block rows with normed states x [n, L, H] and logits
        [n, L, V], when row i follows the gold token prev[:, i]: what `propose` drafts for as long as its drafts
        follow the gold (training, teacher-forced evaluation). DFlash 1: the argmax."""
        return argmax(logits)

    def propose(
        self, hidden: torch.Tensor, anchors: torch.Tensor, temperatures: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Draft tokens [n, L] of block rows 1.. (hidden [n, L, H]): the argmax of each row, point masses (no
        distribution). `anchors` (the bonus tokens), `temperatures` and `uniforms` matter to DFlash 2 only."""
        n, length, _ = hidden.shape
        logits = self.compute_logits(hidden.reshape(n * length, -1))
        return self.map_draft_tokens(argmax(logits)).view(n, length), None

    # ---- checkpoints ----
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens", "lm_head"))}

    def save_pretrained(
        self, path: str | Path, dtype: torch.dtype | None = None, overrides: dict[str, torch.Tensor] | None = None
    ) -> None:
        """config.json + model.safetensors; `overrides` replaces named weights in the file (e.g. a trainer's
        folded fc.weight)."""
        import json

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        sd = {**self.trainable_state_dict(), **(overrides or {})}
        sd = {k: (v.to(dtype) if dtype else v).contiguous().cpu() for k, v in sd.items()}
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        own = self.trainable_state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        if missing or unexpected:
            raise ValueError(f"draft checkpoint mismatch: missing {missing[:6]}, unexpected {unexpected[:6]}")
        for name, w in weights.items():
            if own[name].shape != w.shape:
                raise ValueError(
                    f"draft weight {name} has shape {tuple(w.shape)}, the config implies {tuple(own[name].shape)}"
                )
        self.load_state_dict(weights, strict=False)


def checkpoint_dir(path: str | Path) -> Path:
    """`path` after checking it holds config.json and model.safetensors."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} is not a DFlash checkpoint (needs config.json and model.safetensors)")
    return path


def load_model_weights(
    cls: type[DFlashDraftModel], cfg: DFlashConfig, path: Path, device: torch.device, dtype: torch.dtype
) -> DFlashDraftModel:
    """A `cls` draft of `cfg` with the weights of `path`/model.safetensors, inference-ready in `dtype`."""
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    model = model.to_empty(device=device)  # in `dtype` from the start
    model.load_weights(load_file(str(path / "model.safetensors"), device=str(device)))
    return model.eval().requires_grad_(False)


def load_draft_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> DFlashDraftModel:
    """Reads a DFlash checkpoint directory (config.json + model.safetensors)."""
    path = checkpoint_dir(path)
    return load_model_weights(DFlashDraftModel, DFlashConfig.load(path), path, device, dtype)


def random_draft_model(cfg: DFlashConfig, seed: int = 0, std: float = 0.02) -> DFlashDraftModel:
    """A randomly initialised draft (float32, cpu), for tests and as a training starting point."""
    return randomise_(DFlashDraftModel(cfg), seed, std)


def randomise_(model: DFlashDraftModel, seed: int, std: float) -> DFlashDraftModel:
    """In place: norm weights 1, matrices N(0, std^2), everything else 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.zero_()
    return model
