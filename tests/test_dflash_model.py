"""DFlash draft model: checkpoint round trip (public format), load-time errors that say what is wrong, and
the one-GEMM just-in-time context KV materialisation against the per-layer reference path."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from dflash_helpers import save_tiny_target, tiny_target_config
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_dflash import Engine
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool
from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.dflash import DFlashDraftModel, load_draft_model, random_draft_model
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.models.rotary import rope_at
from sglang_dflash.speculative.dflash_step import DFlashStep, last_writes
from sglang_dflash.speculative.policy import SpecOptions, SpecPolicy

TARGET = tiny_target_config(vocab_size=32, hidden=32, layers=6)
CPU = torch.device("cpu")


def draft_config(**overrides) -> DFlashConfig:
    cfg = DFlashConfig.for_target(TARGET, num_layers=2, block_size=4, mask_token_id=5)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def randomise(model: DFlashDraftModel, seed: int) -> DFlashDraftModel:
    """Every parameter random, norms and biases included (random_draft_model leaves those at 1 / 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else noise)
    return model


def materialize_per_layer(model: DFlashDraftModel, features, positions, out_cache_loc, k_buffer, v_buffer) -> None:
    """The reference for `materialize_context_kv`: each layer's own `project_kv` of the projected context."""
    ctx = model.project_context(features)
    rope = rope_at(model.rope, positions)
    for i, layer in enumerate(model.layers):
        k, v = layer.self_attn.project_kv(ctx, rope)
        k_buffer[i].index_copy_(0, out_cache_loc, k.to(k_buffer.dtype))
        v_buffer[i].index_copy_(0, out_cache_loc, v.to(v_buffer.dtype))


def bind_and_prepare(model: DFlashDraftModel, seed: int = 0) -> DFlashDraftModel:
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(TARGET.vocab_size, TARGET.hidden_size)
    head = nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.2)
    model.bind_target(embed, head)
    model.prepare_inference(CPU)
    return model


def draft_logits(model: DFlashDraftModel, seed: int = 0) -> torch.Tensor:
    """Logits of two padded blocks after materialising random context features (prefixes 5 and 3)."""
    g = torch.Generator().manual_seed(seed)
    cfg, block, prefix = model.config, 4, [5, 3]
    slots = [torch.arange(1, 10), torch.arange(10, 17)]  # each request: context then its block
    k_buffer = torch.zeros(cfg.num_hidden_layers, 20, cfg.num_key_value_heads, cfg.head_dim)
    v_buffer = torch.zeros_like(k_buffer)
    for p, s in zip(prefix, slots):
        features = torch.randn(p, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
        model.materialize_context_kv(features, torch.arange(p), s[:p], k_buffer, v_buffer)
    bonus = torch.randint(cfg.vocab_size, (2,), generator=g)
    input_ids = torch.full((2, block), cfg.mask_token_id)
    input_ids[:, 0] = bonus
    positions = torch.tensor(prefix)[:, None] + torch.arange(block)
    out_cache_loc = torch.stack([s[p : p + block] for s, p in zip(slots, prefix)])
    kv_indices = torch.zeros(2, 9, dtype=torch.int64)
    kv_indices[0], kv_indices[1, :7] = slots[0], slots[1]
    with torch.inference_mode():
        hidden = model(input_ids.flatten(), positions.flatten(), out_cache_loc.flatten(), kv_indices,
                       torch.tensor(prefix) + block, block, k_buffer, v_buffer)
        return model.compute_logits(hidden)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[DFlashDraftModel, Path]:
    model = randomise(DFlashDraftModel(draft_config()), seed=1)
    model.save_pretrained(tmp_path / "draft")
    return bind_and_prepare(model), tmp_path / "draft"


def load(path: Path) -> DFlashDraftModel:
    return bind_and_prepare(load_draft_model(path, CPU, torch.float32))


def test_round_trip_gives_identical_logits(saved):
    model, path = saved
    assert set(load_file(str(path / "model.safetensors"))) == set(model.trainable_state_dict())
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in load_file(str(path / "model.safetensors")))
    assert torch.equal(draft_logits(load(path)), draft_logits(model))


def test_model_prefix_is_stripped(saved, tmp_path: Path):
    model, path = saved
    prefixed = {f"model.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(prefixed, str(path / "model.safetensors"))
    assert torch.equal(draft_logits(load(path)), draft_logits(model))


def test_config_keys_round_trip(saved, tmp_path: Path):
    _, path = saved
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["target_layer_ids"] == [1, 3] and raw["dflash_config"]["mask_token_id"] == 5
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 6
    raw["my_extension"] = {"trained_on": "tests"}
    raw["dflash_config"]["my_setting"] = 7
    (path / "config.json").write_text(json.dumps(raw))
    load_draft_model(path, CPU, torch.float32).save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again == raw


def test_shape_mismatch_names_the_weight(saved):
    _, path = saved
    weights = load_file(str(path / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :40].contiguous()
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(32, 40\).*\(32, 64\)"):
        load_draft_model(path, CPU, torch.float32)


def test_missing_weight_is_named(saved):
    _, path = saved
    weights = load_file(str(path / "model.safetensors"))
    del weights["layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.self_attn\.k_norm\.weight'\]"):
        load_draft_model(path, CPU, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "not a DFlash draft config"),
        ({"dflash_config": {"target_layer_ids": [1, 3]}}, "mask_token_id"),
        ({"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 5, "conv_kernel_size": 4}}, "DFlash2"),
    ],
)
def test_bad_config_fails_with_message(saved, change, message):
    _, path = saved
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        load_draft_model(path, CPU, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target_layer_ids": [1, 6]}, r"target_layer_ids \[6\] out of range for a target with 6 layers"),
        ({"target_layer_ids": [3, 1]}, "strictly increasing"),
        ({"hidden_size": 48}, "draft hidden_size 48 != target hidden_size 32"),
        ({"vocab_size": 64}, "vocab_size"),
        ({"mask_token_id": 32}, "mask_token_id"),
    ],
)
def test_draft_incompatible_with_target(change, message):
    with pytest.raises(ValueError, match=message):
        draft_config(**change).check_target(TARGET)


def test_engine_rejects_incompatible_drafter(tmp_path: Path):
    save_tiny_target(tmp_path / "target", TARGET)
    other = ModelConfig(**{**TARGET.__dict__, "hidden_size": 48, "head_dim": 12})
    random_draft_model(DFlashConfig.for_target(other, 2, 4, 0)).save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="draft hidden_size 48 != target hidden_size 32"):
        Engine(model_path=str(tmp_path / "target"), dtype="float32", speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(tmp_path / "draft"))


@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_gemm_materialisation_matches_per_layer(attention_bias: bool, seed: int):
    """Draft shaped like SmolLM2-135M's layers (H 576, 3 KV heads of 64), 5 layers, fresh random inputs."""
    target = ModelConfig(**{**TARGET.__dict__, "hidden_size": 576, "num_attention_heads": 9,
                            "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
                            "max_position_embeddings": 4096})
    cfg = DFlashConfig.for_target(target, num_layers=5, block_size=16, mask_token_id=0)
    cfg.attention_bias = attention_bias
    model = randomise(DFlashDraftModel(cfg), seed)
    model.prepare_inference(CPU)
    g = torch.Generator().manual_seed(100 + seed)
    n, slots = 37, 200
    features = torch.randn(n, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    positions = torch.randint(0, 4000, (n,), generator=g)
    out_cache_loc = torch.randperm(slots, generator=g)[:n] + 1
    buffers = []
    for materialize in (model.materialize_context_kv, functools.partial(materialize_per_layer, model)):
        k = torch.zeros(cfg.num_hidden_layers, slots + 1, cfg.num_key_value_heads, cfg.head_dim)
        v = torch.zeros_like(k)
        with torch.inference_mode():
            materialize(features, positions, out_cache_loc, k, v)
        buffers.append((k, v))
    (k, v), (k_ref, v_ref) = buffers
    for got, want in ((k, k_ref), (v, v_ref)):
        assert want[:, out_cache_loc].abs().sum(dim=-1).gt(0).all()  # every row was written
        rel = (got - want).abs().max() / want.abs().max()
        assert rel < 1e-5, rel


def deferring_step(model: DFlashDraftModel) -> tuple[DFlashStep, MHATokenToKVPool]:
    """A DFlash step over a fresh 16-slot draft pool (no policy: only its materialisation is used)."""
    cfg = model.config
    pool = MHATokenToKVPool(16, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU)
    return DFlashStep(model, pool, SpecPolicy(SpecOptions(cfg.block_size), None)), pool


def feature_width(cfg: DFlashConfig) -> int:
    return len(cfg.target_layer_ids) * cfg.hidden_size


def test_deferred_materialisation_matches_eager_with_reused_slots():
    """Steps' context K/V wait for one flush; a slot committed twice meanwhile (freed and reused) ends with
    its last write, as writing each step at once would leave it; prefill materialises after what waits."""
    model = randomise(DFlashDraftModel(draft_config()), seed=3)
    model.prepare_inference(CPU)
    g = torch.Generator().manual_seed(7)
    width = feature_width(model.config)
    # (slots, deferred?): slot 0 is the padding slot rejected drafts write to; 4 and 8 are reused
    steps = [([3, 4, 5, 0, 0], True), ([6, 8], True), ([4, 9, 0], True), ([8, 10], False), ([11, 4], True)]
    writes = [(torch.randn(len(s), width, generator=g), torch.randint(0, 60, (len(s),), generator=g),
               torch.tensor(s), deferred) for s, deferred in steps]
    pools = []
    for lazy in (True, False):
        step, pool = deferring_step(model)
        with torch.inference_mode():
            for features, positions, slots, deferred in writes:
                (step.defer if lazy and deferred else step.materialize)(features, positions, slots)
            if lazy:
                assert pool.k_buffer[:, 11].abs().sum() == 0 and step.pending_tokens == 2  # the last step waits
                step.flush()
        assert not step.pending
        pools.append(pool)
    (lazy, eager) = pools
    for got, want in ((lazy.k_buffer, eager.k_buffer), (lazy.v_buffer, eager.v_buffer)):
        assert want[:, [3, 4, 5, 6, 8, 9, 10, 11]].abs().sum(dim=-1).gt(0).all()
        torch.testing.assert_close(got[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-6)


def test_last_writes_keeps_only_the_last_write_of_each_slot():
    """What keeps a flush right where parallel writes to one slot land in any order (GPU scatter, Triton)."""
    slots = torch.tensor([3, 4, 5, 0, 0, 6, 8, 4, 9, 0, 8, 3])
    assert last_writes(slots, 16).tolist() == [0, 0, 5, 0, 0, 6, 0, 4, 9, 0, 8, 3]


def test_deferred_materialisation_flushes_at_its_cap():
    model = randomise(DFlashDraftModel(draft_config()), seed=4)
    model.prepare_inference(CPU)
    step, pool = deferring_step(model)
    step.max_pending_tokens = 4
    width = feature_width(model.config)
    with torch.inference_mode():
        step.defer(torch.randn(3, width), torch.arange(3), torch.tensor([1, 2, 3]))
        assert step.pending_tokens == 3 and pool.k_buffer[:, 1:4].abs().sum() == 0
        step.defer(torch.randn(2, width), torch.arange(3, 5), torch.tensor([4, 5]))
    assert step.pending_tokens == 0 and pool.k_buffer[:, 1:6].abs().sum(dim=-1).gt(0).all()
