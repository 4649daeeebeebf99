"""Llama-family and Qwen3 decoder (our own torch forward) over the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang_dflash.engine.attention import AttentionMetadata, TorchNativeAttnBackend
from sglang_dflash.engine.forward_batch import ForwardBatch
from sglang_dflash.engine.memory_pool import MHATokenToKVPool
from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.rotary import apply_rotary, build_cos_sin_cache


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as HF Llama does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.hd**-0.5

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, fb: ForwardBatch, pool: MHATokenToKVPool,
        attn: TorchNativeAttnBackend, meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd)
        k = self.k_proj(x).view(T, self.nkv, self.hd)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        o = attn.forward(q, pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id], meta, self.scale)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos_sin, fb, pool, attn, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, fb, pool, attn, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor | None  # [n, V] float32 for fb.logits_indices
    hidden_states: torch.Tensor | None  # [T, K * H] captured layers, concatenated in layer order


class CausalLM(nn.Module):
    """The target model. forward() runs one ForwardBatch and writes its K/V into the pool."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.cos_sin_cache: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Shares embedding and lm_head (call again after to_empty, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, device: torch.device) -> None:
        c = self.config
        self.cos_sin_cache = build_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta, device)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        if self.config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        missing = set(params) - set(weights) - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        unexpected = {k for k in weights if k not in params and "rotary_emb" not in k}
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            for name, w in weights.items():
                if name in params:
                    if params[name].shape != w.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != {tuple(params[name].shape)}")
                    params[name].copy_(w)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, pool: MHATokenToKVPool, attn: TorchNativeAttnBackend, meta: AttentionMetadata
    ) -> LogitsOutput:
        h = self.model.embed_tokens(fb.input_ids)
        cos_sin = self.cos_sin_cache.index_select(0, fb.positions)
        captured = []
        capture = fb.capture_layer_ids or ()
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos_sin, fb, pool, attn, meta)
            if i in capture:
                captured.append(h)
        logits = None
        if fb.logits_indices is not None:
            logits = self.compute_logits(h.index_select(0, fb.logits_indices))
        hidden = torch.cat(captured, dim=-1) if captured else None
        return LogitsOutput(logits, hidden)
