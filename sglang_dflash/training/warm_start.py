"""A draft that starts from the target's own last layers instead of random matrices.

Draft layer i takes the weights of target layer N - n + i (n draft layers; q_norm / k_norm stay 1, the target has
none); `fc` passes the last captured layer's hidden state through (its block of the trained fc is diag(scale),
the trainer's features being divided by the per-dimension scale), `hidden_norm` is the input norm of the layer
after it, `norm` the target's final norm. So the first draft layer's context K/V are (up to the k norm) what the
target's own next layer computes from that hidden state."""

from __future__ import annotations

import torch

from sglang_dflash.models.dflash import DFlashDraftModel

LAYER_PARAMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def init_from_target_layers_(draft: DFlashDraftModel, target: dict[str, torch.Tensor], feature_scale: torch.Tensor,
                             num_target_layers: int) -> None:
    """In place (see the module docstring); `target`: the target's weights by HF name."""
    cfg = draft.config
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    first = num_target_layers - n
    last_captured = cfg.target_layer_ids[-1]
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            for name in LAYER_PARAMS:
                layer.get_submodule(name).weight.copy_(target[f"model.layers.{first + i}.{name}.weight"])
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.diag(feature_scale[-h:].to(draft.fc.weight))
        next_layer = min(last_captured + 1, num_target_layers - 1)
        draft.hidden_norm.weight.copy_(target[f"model.layers.{next_layer}.input_layernorm.weight"])
        draft.norm.weight.copy_(target["model.norm.weight"])
