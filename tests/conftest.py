"""Shared fixtures: the default SmolLM2 engine (float32), transformers' own model of the same GGUF,
a tiny random Qwen3 checkpoint, and helpers to run raw forwards and check KV bookkeeping."""

from __future__ import annotations

import os

from sglang_dflash.device import accelerator

# Triton kernels run on CPU tensors through the interpreter, which Triton only honours when the variable
# is set before it is first imported (transformers imports it), so it is set here, before anything else.
if accelerator() is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ctypes
import gc
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sglang_dflash import Engine
from sglang_dflash.models.default_model import default_model_path
from sglang_dflash.models.model_store import cache_root, file_sha256, resolve_model_dir
from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.runtime.model_runner import ModelRunner

ENGINE_POOL = 8192  # KV slots of the shared engine
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a linked list is in two sentences.",
    "Give me three tips for staying focused while studying.",
    "How many legs does a spider have, and why?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python one-liner that reverses a string.",
    "Why is the sky blue?",
]


@pytest.fixture
def force_kernels(monkeypatch: pytest.MonkeyPatch):
    """force_kernels(value): SGLANG_DFLASH_KERNELS=value (None: unset) for this test; the kernel backend is read once
    per process (`forced_backend`), so its cache is cleared with each change and after the test."""
    from sglang_dflash.kernels.backend import ENV_VAR, forced_backend

    def force(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, value)
        forced_backend.cache_clear()

    yield force
    forced_backend.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def release_helper_engines() -> None:
    """The helpers' cached engines (about 1 GB each in float32) live for one test module: holding all of them for
    the whole run, beside the servers of the HTTP and plugin tests, got a clean-clone CI run killed for memory
    (24 GiB machine, the pytest process at 10 GB)."""
    yield
    import dflash_helpers

    dflash_helpers.ar_engine.cache_clear()
    dflash_helpers.dflash_engine.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed memory in its arenas otherwise
    except (OSError, AttributeError):
        pass


# ---- the default model ----
@pytest.fixture(scope="session")
def engine() -> Engine:
    """The default SmolLM2-135M target in float32 (exactness tests); shared, so tests must leave it idle."""
    eng = Engine(dtype="float32", max_total_tokens=ENGINE_POOL)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def runner(engine: Engine) -> ModelRunner:
    return engine.scheduler.worker.model_runner


@pytest.fixture(scope="session")
def chat_ids(engine: Engine) -> list[list[int]]:
    """CHAT_PROMPTS as token ids, chat template applied."""
    return [engine.tokenizer_manager.chat_ids([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own model of the default GGUF (test-only use), float32. Its dequantisation is slow
    (~15-60 s), so the loaded weights are cached under the user cache dir, keyed by the GGUF's hash."""
    from transformers import AutoModelForCausalLM

    gguf = default_model_path()
    cached = cache_root() / "hf_reference" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if not (cached / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tmp = cached.with_name(cached.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        tied = model.config.tie_word_embeddings
        weights = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the cached copy is a plain float32 checkpoint
        (tmp / "config.json").write_text(json.dumps(config))
        shutil.rmtree(cached, ignore_errors=True)
        tmp.rename(cached)
    return AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()


# ---- a tiny random Qwen3 ----
@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised Qwen3 (q/k norm, head_dim != hidden / heads, untied lm_head) saved by
    transformers as safetensors, with the default model's tokenizer files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3")
    tok_dir = resolve_model_dir(None)
    cfg = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a wrong norm cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


# ---- raw forwards ----
def forward_tokens(
    runner: ModelRunner, seqs: list[list[int]], prefix_lens: list[int] | None = None,
    capture: tuple[int, ...] | None = None, mode: ForwardMode = ForwardMode.EXTEND,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One forward of whole sequences as a ragged batch; the first prefix_lens[i] tokens of sequence i
    are run first as a separate EXTEND (cached prefix). Returns per sequence the logits [n, V] and
    captured hidden states of the new tokens. Frees everything it allocated."""
    prefix_lens = prefix_lens or [0] * len(seqs)
    rows = [runner.req_to_token_pool.alloc() for _ in seqs]
    slots = runner.token_to_kv_pool_allocator.alloc(sum(map(len, seqs)))
    assert slots is not None and None not in rows
    table = runner.req_to_token_pool.req_to_token
    try:
        start = 0
        for row, s in zip(rows, seqs):
            table[row, : len(s)] = slots[start : start + len(s)]
            start += len(s)
        cached = [(r, s, p) for r, s, p in zip(rows, seqs, prefix_lens) if p]
        if cached:
            fb = ForwardBatch.build(
                ForwardMode.EXTEND, [t for _, s, p in cached for t in s[:p]], [r for r, _, _ in cached],
                [0] * len(cached), [p for _, _, p in cached], table, runner.device, logits="none",
            )
            runner.forward(fb)
        new = [len(s) - p for s, p in zip(seqs, prefix_lens)]
        fb = ForwardBatch.build(
            mode, [t for s, p in zip(seqs, prefix_lens) for t in s[p:]], rows, prefix_lens, new, table,
            runner.device, logits="all", capture_layer_ids=capture,
        )
        out = runner.forward(fb)
        logits = list(out.next_token_logits.float().split(new))
        hidden = None if out.hidden_states is None else list(out.hidden_states.split(new))
        return logits, hidden
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---- KV bookkeeping ----
def assert_kv_clean(engine: Engine) -> None:
    """No request anywhere, every token slot and request row free, nothing in flight."""
    sched = engine.scheduler
    assert not sched.has_work(), "requests left in the scheduler"
    assert not getattr(sched, "deferred_frees", []), "frees still deferred"
    alloc, rows = sched.allocator, sched.req_to_token_pool
    assert alloc.available_size() == alloc.size, f"{alloc.size - alloc.available_size()} token slots leaked"
    assert rows.available_size() == rows.size, f"{rows.size - rows.available_size()} request rows leaked"
    assert sorted(rows.free_slots) == list(range(rows.size)), "a request row was freed twice"


@pytest.fixture(scope="session")
def kv_clean() -> Callable[[Engine], None]:
    return assert_kv_clean


@pytest.fixture(scope="session", name="forward_tokens")
def forward_tokens_fixture() -> Callable[..., tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
    return forward_tokens


@pytest.fixture(scope="session", name="rel_err")
def rel_err_fixture() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return rel_err


@pytest.fixture(scope="session")
def greedy() -> Callable[..., dict]:
    """Greedy sampling params (float32 exactness), overridable: greedy(max_new_tokens=8, stop=...)."""
    return lambda **kw: {"temperature": 0, "max_new_tokens": 32, **kw}
