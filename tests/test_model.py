"""Our forward vs transformers' model on the same weights: logits and captured hidden states (float32),
ragged / chunked / verify batches, the Qwen3 path, and the packed bf16 linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_dflash.device import memory_info
from sglang_dflash.models.packed_linear import PackedLinear, can_pack
from sglang_dflash.runtime import attention
from sglang_dflash.runtime.forward_batch import ForwardMode
from sglang_dflash.runtime.model_runner import ModelRunner, kv_pool_tokens

CAPTURE = (0, 13, 27)  # not the last layer: HF's last hidden state is after the final norm
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each step as his father "
    "had taught him, and at the top he polished the great lens until it shone like a second moon over "
    "the restless grey sea."
)


@pytest.fixture(scope="module")
def prompt64(engine) -> list[int]:
    ids = engine.tokenizer_manager.encode(PROMPT * 2)[:64]
    assert len(ids) == 64
    return ids


def hf_forward(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True)


@pytest.mark.parametrize("path", ["gemm", "sdpa"])
def test_smollm2_matches_transformers_gguf(runner, hf_model, prompt64, forward_tokens, rel_err, monkeypatch, path):
    if path == "sdpa":  # the prefill attention path (long queries)
        monkeypatch.setattr(attention, "SMALL_Q", 0)
    (logits,), (hidden,) = forward_tokens(runner, [prompt64], capture=CAPTURE)
    ref = hf_forward(hf_model, prompt64)
    err = rel_err(logits, ref.logits[0])
    print(f"SmolLM2 fp32 logits rel err ({path}): {err:.2e}")
    assert err < 1e-4
    assert torch.equal(logits.argmax(-1), ref.logits[0].argmax(-1))
    for i, k in enumerate(CAPTURE):
        width = runner.model_config.hidden_size
        h = hidden[:, i * width : (i + 1) * width]
        assert rel_err(h, ref.hidden_states[k + 1][0]) < 1e-4, f"captured layer {k}"


def test_qwen3_safetensors_matches_transformers(tiny_qwen3_dir, forward_tokens, rel_err):
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(str(tiny_qwen3_dir), torch.device("cpu"), torch.float32, 512, 4)
    assert runner.model_config.qk_norm and not runner.model_config.tie_word_embeddings
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    (logits,), (hidden,) = forward_tokens(runner, [ids], capture=(0, 2))
    ref = hf_forward(hf, ids)
    err = rel_err(logits, ref.logits[0])
    print(f"tiny Qwen3 fp32 logits rel err: {err:.2e}")
    assert err < 1e-4
    assert rel_err(hidden[:, :64], ref.hidden_states[1][0]) < 1e-4
    assert rel_err(hidden[:, 64:], ref.hidden_states[3][0]) < 1e-4


def test_ragged_cached_and_verify_batches_agree(runner, prompt64, forward_tokens, rel_err):
    """One sequence alone == the same sequence in a ragged batch == after a cached prefix, in EXTEND
    and TARGET_VERIFY modes (the attention sees prefix + causal block either way)."""
    other = prompt64[5:40]
    (alone,), _ = forward_tokens(runner, [prompt64])
    batch, _ = forward_tokens(runner, [other, prompt64])
    cached, _ = forward_tokens(runner, [prompt64, other], prefix_lens=[48, 20])
    verify, _ = forward_tokens(runner, [prompt64, other], prefix_lens=[48, 32], mode=ForwardMode.TARGET_VERIFY)
    assert rel_err(batch[1], alone) < 1e-5
    assert rel_err(cached[0], alone[48:]) < 1e-5
    assert rel_err(verify[0], alone[48:]) < 1e-5
    (other_alone,), _ = forward_tokens(runner, [other])
    assert rel_err(batch[0], other_alone) < 1e-5
    assert rel_err(cached[1], other_alone[20:]) < 1e-5


def test_bf16_model_close_to_float32(hf_model, prompt64, forward_tokens, rel_err):
    """The production dtype (packed oneDNN linears where the CPU supports them) stays close to fp32."""
    runner = ModelRunner(None, torch.device("cpu"), torch.bfloat16, 256, 2)
    packed = can_pack(torch.device("cpu"), torch.bfloat16)
    assert any(isinstance(m, PackedLinear) for m in runner.model.modules()) == packed
    (logits,), _ = forward_tokens(runner, [prompt64])
    ref = hf_forward(hf_model, prompt64).logits[0]
    assert rel_err(logits, ref) < 0.1
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.85


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_matches_linear(dtype, tol):
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True).to(dtype)
    packed = PackedLinear(lin, keep_weight=True)
    for m in (1, 3, 17, 80):
        x = torch.randn(m, 96, dtype=dtype)
        ref = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
        assert (packed(x).double() - ref).abs().max() <= tol * ref.abs().max()
    wide = torch.randn(2, 5, 192, dtype=dtype)[..., ::2]  # non-contiguous, 3-d
    ref = nn.functional.linear(wide.double(), lin.weight.double(), lin.bias.double())
    assert (packed(wide).double() - ref).abs().max() <= tol * ref.abs().max()
    x = torch.randn(2, 96, dtype=dtype, requires_grad=True)  # autograd falls back to the plain weight
    packed(x).sum().backward()
    assert torch.allclose(x.grad.float(), lin.weight.float().sum(0).expand(2, -1), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="inference-only"):
        PackedLinear(lin)(x)


def test_weights_load_in_the_target_dtype(runner):
    """Allocated in bf16 from the start (no float32 copy on the device), equal to the float32 weights rounded."""
    bf16 = ModelRunner(None, torch.device("cpu"), torch.bfloat16, 64, 1)
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.3.input_layernorm.weight"):
        got, want = bf16.model.get_parameter(name), runner.model.get_parameter(name)
        torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0, msg=name)


def test_kv_pool_sized_from_free_memory():
    gib = 2**30
    # weights + KV may take 85% of 16 GiB; 10 GiB are free after the weights and 1 GiB more is still to load
    assert kv_pool_tokens(10 * gib, 16 * gib, 0.85, 1000, reserved=gib) == int((10 - 16 * 0.15 - 1) * gib // 1000)
    with pytest.raises(ValueError, match="mem_fraction_static 0.5 leaves no memory"):
        kv_pool_tokens(4 * gib, 16 * gib, 0.5, 1000)
    # on cpu when mem_fraction_static is given, host memory sizes the pool: 1 GiB for weights + KV here (the
    # weights, ~0.3 GB in bf16, come out of it: free memory is measured after them)
    free, total = memory_info("cpu")
    fraction = 1 - (free - gib) / total
    runner = ModelRunner(None, torch.device("cpu"), torch.bfloat16, None, 1, mem_fraction_static=fraction)
    cfg = runner.model_config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    assert 100 * 2**20 // per_token < runner.max_total_tokens < 2 * gib // per_token  # other processes move "free"
    assert runner.token_to_kv_pool.k_buffer[0].shape[0] >= runner.max_total_tokens
