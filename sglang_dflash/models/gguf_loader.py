"""Reads a GGUF file (Llama or Qwen3): config, dequantised weights with HF names, tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from sglang_dflash.models.config import ModelConfig

_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH)}")
    p = f"{arch}."
    hidden = _field(reader, p + "embedding_length")
    heads = _field(reader, p + "attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCH[arch],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, p + "context_length")),
        tie_word_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TENSOR_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (it converts HF's rotate-half layout to GPT-J's)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader: gguf.GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantises every tensor to float32 with HF names and shapes."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.array(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        name = _hf_name(t.name)
        if cfg.model_type == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg.num_key_value_heads)
        out[name] = torch.from_numpy(w)
    return out


def load_gguf_tokenizer(path: Path):
    """The tokenizer and chat template stored in the GGUF file, as a transformers fast tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
