"""Llama-family and Qwen3 decoder (our own torch forward) over the paged KV pool.

q/k/v and gate/up projections are merged into one GEMM each; checkpoints load per shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.kernels.rms_norm import rms_norm
from sglang_dflash.kernels.rope import rope_set_kv
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool
from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.rotary import build_cos_sin_cache, rope_at, rope_table
from sglang_dflash.runtime.attention import GroupedMetadata, TorchNativeAttnBackend
from sglang_dflash.runtime.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    """RMSNorm (`kernels.rms_norm`: in float32 torch's fused kernel, which equals HF's formula bit for bit)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU MLP with separate projections (the DFlash draft's layout)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MergedLinear(nn.Linear):
    """Projections of one input stacked on the output dim; `shards` maps checkpoint names to row counts."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections in one GEMM."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.nh * self.hd, self.nkv * self.hd
        shards = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        self.qkv_proj = MergedLinear(cfg.hidden_size, shards, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.hd**-0.5

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch, pool: MHATokenToKVPool,
        attn: TorchNativeAttnBackend, meta: GroupedMetadata,
    ) -> torch.Tensor:
        T, nh = x.shape[0], self.nh
        qkv = self.qkv_proj(x)
        split = (nh + self.nkv) * self.hd
        qk = qkv[:, :split].view(T, nh + self.nkv, self.hd)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        v = qkv[:, split:].view(T, self.nkv, self.hd)
        q = rope_set_kv(qk, v, *rope, pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], fb.out_cache_loc)
        o = attn.forward(q, pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], meta, self.scale)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, fb, pool, attn, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, fb, pool, attn, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor | None  # [n, V] in the model's dtype for fb.logits_indices
    hidden_states: torch.Tensor | None  # [T, K * H] captured layers, concatenated in layer order


class CausalLM(nn.Module):
    """The target model. forward() runs one ForwardBatch and writes its K/V into the pool."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope_cache: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Shares embedding and lm_head (call again after to_empty, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, device: torch.device) -> None:
        """The RoPE table in the model dtype, where the target's RoPE computes (call after .to(dtype))."""
        c = self.config
        cache = build_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta, device)
        self.rope_cache = rope_table(cache, self.model.embed_tokens.weight.dtype)

    def checkpoint_layout(self) -> dict[str, tuple[str, slice | None]]:
        """Checkpoint tensor name -> (our parameter name, its rows or None for all of it)."""
        layout: dict[str, tuple[str, slice | None]] = {name: (name, None) for name, _ in self.named_parameters()}
        for mod_name, mod in self.named_modules():
            if not isinstance(mod, MergedLinear):
                continue
            parent = mod_name.rpartition(".")[0]
            kinds = ("weight", "bias") if mod.bias is not None else ("weight",)
            start = 0
            for shard, rows in mod.shards.items():
                for kind in kinds:
                    layout.pop(f"{mod_name}.{kind}", None)
                    layout[f"{parent}.{shard}.{kind}"] = (f"{mod_name}.{kind}", slice(start, start + rows))
                start += rows
        return layout

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        layout = self.checkpoint_layout()
        if self.config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        missing = set(layout) - set(weights)
        unexpected = {k for k in weights if k not in layout and "rotary_emb" not in k}
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            for name, w in weights.items():
                if name not in layout:
                    continue
                param_name, rows = layout[name]
                dst = params[param_name] if rows is None else params[param_name][rows]
                if dst.shape != w.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != {tuple(dst.shape)}")
                dst.copy_(w)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: greedy decoding takes their argmax as they are (a bf16 value converts to
        float32 exactly, so the argmax is the same); whatever computes with them (penalties, softmax) goes to
        float32 first. A float32 copy of a 32-row step's logits cost ~0.45 ms on a 2-core CPU."""
        return self.lm_head(self.model.norm(h))

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, pool: MHATokenToKVPool, attn: TorchNativeAttnBackend, meta: GroupedMetadata
    ) -> LogitsOutput:
        h = self.model.embed_tokens(fb.input_ids)
        rope = rope_at(self.rope_cache, fb.positions)
        captured = []
        capture = fb.capture_layer_ids or ()
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, fb, pool, attn, meta)
            if i in capture:
                captured.append(h)
        logits = None
        if fb.logits_indices is not None:
            logits = self.compute_logits(h.index_select(0, fb.logits_indices))
        hidden = torch.cat(captured, dim=-1) if captured else None
        return LogitsOutput(logits, hidden)
