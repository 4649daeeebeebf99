"""DFlash 2: a checkpoint written by the reference implementation (tests/fixtures/dflash2_tiny, from
scripts/make_dflash2_fixture.py) loads and reproduces the reference's block states, logits, greedy paths and
sparse draft distributions; ours saves the same format; the sparse-draft rejection sampler (Triton vs torch,
vs a naive loop, vs the point-mass kernel); greedy DFLASH == AR through the engine with a DFlash 2 drafter;
the sampled distribution stays the target's with sampled paths, lookup proposals mixed in."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from dflash_helpers import ar_engine, ar_reference, chat_ids, default_target_config, tiny_target_config
from safetensors.torch import load_file
from test_lossless_sampling import (
    LOOKUP_PROMPT,
    NUM_SAMPLES,
    PROMPT,
    SETTINGS,
    chi_square_p_value,
    engine_kwargs,
    exact_distribution,
    save_tiny_setup,
)
from torch import nn

import sglang_dflash.speculative.accept as accept_module
from sglang_dflash import Engine
from sglang_dflash.device import accelerator
from sglang_dflash.kernels import sampling_accept, sparse_sampling_accept, sparse_sampling_accept_torch
from sglang_dflash.kernels.backend import triton_available
from sglang_dflash.models.dflash import DFlashDraftModel
from sglang_dflash.models.dflash2 import (
    DFlash2Config,
    DFlash2DraftModel,
    dflash1_equivalent_,
    load_dflash2_model,
    random_dflash2_model,
)
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.sampling.sampler import sample_from_probs
from sglang_dflash.speculative.accept import point_masses
from sglang_dflash.speculative.drafter import load_drafter

FIXTURE = Path(__file__).parent / "fixtures" / "dflash2_tiny"
CPU = torch.device("cpu")
DEVICE = accelerator() or CPU
TEMPERATURE = 0.7  # the fixture's sampled paths


def dflash2_config(base: DFlashConfig, taps: int = 3, group: int = 8, rank: int = 8, top_k: int = 4) -> DFlash2Config:
    return DFlash2Config.extend(base, taps, group, rank, top_k)


# ---------------------------------------------------------------- the reference checkpoint


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


def bind(model: DFlash2DraftModel, ref: dict[str, torch.Tensor]) -> DFlash2DraftModel:
    """The fixture's target embedding and head, then the inference set-up."""
    head = nn.Linear(ref["head"].shape[1], ref["head"].shape[0], bias=False)
    head.weight.data.copy_(ref["head"])
    model.bind_target(nn.Embedding.from_pretrained(ref["embed"]), head)
    model.prepare_inference(CPU)
    return model


def block_states(model: DFlash2DraftModel, ref: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final states (before the norm) [2, B - 1, H] of rows 1.. of the fixture's two requests' blocks, through
    our paged path: the context K/V materialised into the cache, then the padded block forward."""
    cfg, block = model.config, model.config.block_size
    prefix = [ref[f"{r}.features"].shape[0] for r in range(2)]
    slots = [torch.arange(1, 1 + prefix[0] + block), torch.arange(20, 20 + prefix[1] + block)]
    k_buffer = torch.zeros(cfg.num_hidden_layers, 40, cfg.num_key_value_heads, cfg.head_dim)
    v_buffer = torch.zeros_like(k_buffer)
    kv_indices = torch.zeros(2, max(prefix) + block, dtype=torch.int64)
    for r, (p, s) in enumerate(zip(prefix, slots)):
        model.materialize_context_kv(ref[f"{r}.features"], torch.arange(p), s[:p], k_buffer, v_buffer)
        kv_indices[r, : p + block] = s
    input_ids = torch.full((2, block), cfg.mask_token_id)
    input_ids[:, 0] = torch.cat([ref["0.bonus"], ref["1.bonus"]])
    positions = torch.tensor(prefix)[:, None] + torch.arange(block)
    out_cache_loc = torch.stack([s[p : p + block] for s, p in zip(slots, prefix)])
    with torch.inference_mode():
        hidden = model(input_ids.flatten(), positions.flatten(), out_cache_loc.flatten(), kv_indices,
                       torch.tensor(prefix) + block, block, k_buffer, v_buffer)
    return hidden.view(2, block, -1)[:, 1:]


def by_token(ids: torch.Tensor, q: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), p.tolist())) for i, p in zip(ids, q)]


def teacher_forced_q(model: DFlash2DraftModel, hidden: torch.Tensor, anchor: torch.Tensor, path: torch.Tensor):
    """Our candidates and q rows [L, K] of one request along a given path (the reference's sampled one)."""
    x = model.norm(hidden)
    unary, ids = model.head_logits(x).topk(model.config.selector_top_k, dim=-1)
    h = model.candidate_selector.hidden_projection(x)
    prev = torch.cat([anchor, path[:-1]])
    scores = model.candidate_selector.scores(h, prev, unary, ids)
    return ids, torch.softmax(scores / TEMPERATURE, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_reference_checkpoint_matches_reference(ref):
    model = bind(load_dflash2_model(FIXTURE, CPU, torch.float32), ref)
    cfg = model.config
    assert (cfg.rope_theta, cfg.sliding_window, cfg.output_multiplier) == (5000.0, 3, 0.8)
    assert [layer.self_attn.causal for layer in model.layers] == [True, False]  # the reference's default rule
    hidden = block_states(model, ref)
    with torch.inference_mode():
        greedy, none = model.propose(hidden, torch.cat([ref["0.bonus"], ref["1.bonus"]]))
        temperatures, uniforms = torch.full((2,), TEMPERATURE), torch.rand(2, hidden.shape[1])
        sampled, (ids, q) = model.propose(hidden, torch.cat([ref["0.bonus"], ref["1.bonus"]]), temperatures, uniforms)
    assert none is None
    for r in range(2):
        assert rel(model.norm(hidden[r]), ref[f"{r}.hidden"]) < 1e-5
        assert rel(model.head_logits(model.norm(hidden[r])), ref[f"{r}.logits"]) < 1e-5
        assert greedy[r].tolist() == ref[f"{r}.greedy"].tolist()
        # the reference's sampled path, walked by our selector: the same candidates with the same q
        ours_ids, ours_q = teacher_forced_q(model, hidden[r], ref[f"{r}.bonus"], ref[f"{r}.sampled"])
        for mine, theirs in zip(by_token(ours_ids, ours_q), by_token(ref[f"{r}.candidates"], ref[f"{r}.q"])):
            assert mine.keys() == theirs.keys()
            assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-5
        # our own sampled path: each token one of its position's candidates, q the teacher-forced q of that path
        assert all(t in row for t, row in zip(sampled[r].tolist(), ids[r].tolist()))
        forced_ids, forced_q = teacher_forced_q(model, hidden[r], ref[f"{r}.bonus"], sampled[r])
        assert torch.equal(forced_ids, ids[r]) and rel(forced_q, q[r]) < 1e-6


def test_save_round_trip_keeps_the_published_format(ref, tmp_path: Path):
    model = load_dflash2_model(FIXTURE, CPU, torch.float32)
    model.save_pretrained(tmp_path / "again")
    theirs, ours = (load_file(str(p / "model.safetensors")) for p in (FIXTURE, tmp_path / "again"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    raw, saved = (json.loads((p / "config.json").read_text()) for p in (FIXTURE, tmp_path / "again"))
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert {k: saved["dflash_config"][k] for k in raw["dflash_config"]} == raw["dflash_config"]
    again = bind(load_dflash2_model(tmp_path / "again", CPU, torch.float32), ref)
    assert torch.equal(block_states(again, ref), block_states(bind(model, ref), ref))


def test_load_drafter_reads_the_architecture():
    target = tiny_target_config(vocab_size=64, hidden=32, layers=4)
    embed, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    draft = load_drafter(FIXTURE, CPU, torch.float32, target, embed, head)
    assert isinstance(draft, DFlash2DraftModel) and draft.samples_paths
    raw = json.loads((FIXTURE / "config.json").read_text())
    del raw["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="selector_top_k"):
        DFlash2Config.from_dict(raw)


def test_silent_additions_reproduce_dflash1(ref):
    """A DFlash 2 draft whose convolutions are the identity and whose selector has no pair term proposes
    exactly what the DFlash 1 draft with the same shared weights proposes."""
    dflash2 = load_dflash2_model(FIXTURE, CPU, torch.float32)
    dflash1_equivalent_(dflash2)
    for layer in dflash2.layers:
        layer.self_attn.causal, layer.self_attn.sliding_window = False, None
    cfg = dflash2.config
    cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale = 1.0, None, 1.0
    cfg.layer_types = cfg.sliding_window = None
    dflash1 = DFlashDraftModel(cfg)
    dflash1.load_state_dict(dflash2.state_dict(), strict=False)
    h1, h2 = block_states(bind(dflash1, ref), ref), block_states(bind(dflash2, ref), ref)
    assert rel(h2, h1) < 1e-6
    anchors = torch.cat([ref["0.bonus"], ref["1.bonus"]])
    assert torch.equal(dflash2.propose(h2, anchors)[0], dflash1.propose(h1, anchors)[0])


# ---------------------------------------------------------------- sparse-draft rejection sampling


def sparse_case(bs: int, block: int, vocab: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Random target rows, drafts sampled from random sparse q over k distinct candidates (some candidates the
    target rules out), lookup-style point masses in some rows, ragged block lengths."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(bs, block, vocab, generator=g) ** 4
    probs[probs < 0.05] = 0  # sparse target rows, so residuals that are zero and p < q both occur
    probs[:, :, 0] += 1e-3
    probs /= probs.sum(-1, keepdim=True)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(bs * block)]).view(bs, block, k)
    q = torch.softmax(torch.randn(bs, block, k, generator=g) * 2, -1)
    picks = torch.multinomial(q.view(-1, k), 1, generator=g).view(bs, block)
    drafts = ids.gather(2, picks[..., None]).squeeze(2)
    candidates = torch.cat([torch.randint(vocab, (bs, 1), generator=g), drafts[:, :-1]], 1)
    point = torch.rand(bs, generator=g) < 0.3  # these rows: point masses in the sparse form
    pm_ids, pm_q = point_masses(candidates, k)
    ids, q = torch.where(point[:, None, None], pm_ids, ids), torch.where(point[:, None, None], pm_q, q)
    return {
        "target_probs": probs, "candidates": candidates, "block_lens": torch.randint(1, block + 1, (bs,), generator=g),
        "draft_ids": ids, "draft_probs": q, "uniforms": torch.rand(bs, block, generator=g),
        "bonus_uniforms": torch.rand(bs, generator=g),
    }


def strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a non-contiguous view (every dim stepped by 2, dims in reversed memory order)."""
    buf = t.new_zeros([2 * s + 1 for s in reversed(t.shape)]).permute(*reversed(range(t.dim())))
    view = buf[tuple(slice(1, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def naive_sparse_accept(case: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """The rule in plain loops, in float64 for the residual (the kernels' fixed point draws differ only at
    exact cdf ties, which random inputs do not hit)."""
    accepts, bonuses = [], []
    for i in range(case["candidates"].shape[0]):
        acc, n = 0, int(case["block_lens"][i]) - 1
        while acc < n:
            d = int(case["candidates"][i, acc + 1])
            q = sum(float(p) for t, p in zip(case["draft_ids"][i, acc], case["draft_probs"][i, acc]) if int(t) == d)
            if not float(case["uniforms"][i, acc]) * q < float(case["target_probs"][i, acc, d]):
                break
            acc += 1
        p = case["target_probs"][i, acc].double()
        residual = p.clone()
        if acc < n:
            for t, qt in zip(case["draft_ids"][i, acc], case["draft_probs"][i, acc]):
                residual[int(t)] -= float(qt)
            residual = residual.clamp_min(0)
        if residual.sum() == 0:
            residual = p
        cdf = (residual / residual.sum()).cumsum(0)
        bonuses.append(min(int((cdf <= float(case["bonus_uniforms"][i])).sum()), p.shape[0] - 1))
        accepts.append(acc)
    return accepts, bonuses


@pytest.mark.parametrize("shape", [(5, 4, 37, 3), (3, 7, 211, 6), (9, 16, 1001, 5)], ids=str)
def test_sparse_accept_torch_matches_naive(shape):
    case = sparse_case(*shape, seed=sum(shape))
    accepts, bonuses, _ = sparse_sampling_accept_torch(**case)
    assert (accepts.tolist(), bonuses.tolist()) == naive_sparse_accept(case)


def test_point_masses_reduce_to_the_point_mass_kernel():
    case = sparse_case(11, 6, 97, 4, seed=3)
    ids, q = point_masses(case["candidates"], 4)
    sparse = sparse_sampling_accept_torch(**{**case, "draft_ids": ids, "draft_probs": q})
    plain = sampling_accept(case["target_probs"], case["candidates"], case["block_lens"], case["uniforms"],
                            case["bonus_uniforms"])
    assert all(torch.equal(a, b) for a, b in zip(sparse, plain))


@pytest.mark.skipif(not triton_available(), reason="triton unusable")
@pytest.mark.parametrize("shape", [(1, 1, 13, 1), (5, 4, 37, 3), (3, 7, 211, 6), (6, 16, 5000, 5)], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_sparse_accept_triton_matches_torch(shape, layout):
    """Fresh random, odd-sized inputs; without a GPU the Triton kernel runs through the interpreter on CPU."""
    triton_impl = importlib.import_module("sglang_dflash.kernels.sparse_sampling_triton").sparse_sampling_accept_triton
    case = sparse_case(*shape, seed=7 * sum(shape))
    expected = sparse_sampling_accept_torch(**case)
    args = {k: v.to(DEVICE) for k, v in case.items()}
    actual = triton_impl(**({k: strided(v) for k, v in args.items()} if layout == "strided" else args))
    for a, e in zip(actual, expected):
        assert a.dtype == torch.int64 and a.is_contiguous() and torch.equal(a.cpu(), e)


def test_sparse_accept_dispatch_checks_shapes():
    case = sparse_case(2, 4, 20, 3, seed=0)
    with pytest.raises(AssertionError):
        sparse_sampling_accept(**{**case, "draft_probs": case["draft_probs"][:, :, :2]})


# ---------------------------------------------------------------- the engine, greedy


GREEDY_TOKENS = 48
GREEDY_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "List the planets of the solar system in order.",
    "Explain what a linked list is.",
]


@pytest.fixture(scope="module")
def smollm_dflash2(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The default target with a random DFlash 2 drafter (2 layers, block 8), lookup on, fixed blocks: the
    adaptive policy would (rightly) stop drafting with a random drafter, and this engine must run DFlash 2."""
    path = tmp_path_factory.mktemp("dflash2") / "draft"
    base = DFlashConfig.for_target(default_target_config(), 2, 8, mask_token_id=0)
    cfg = dflash2_config(base, taps=4, group=64, rank=16, top_k=8)
    random_dflash2_model(cfg, seed=0, std=0.05).save_pretrained(path)
    engine = Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(path), speculative_adaptive=False, speculative_lookup=True)
    yield engine
    engine.shutdown()


def test_engine_greedy_dflash2_matches_ar(smollm_dflash2: Engine):
    assert isinstance(smollm_dflash2.scheduler.worker.step.draft, DFlash2DraftModel)
    prompts = chat_ids(ar_engine(), GREEDY_PROMPTS)
    reference = ar_reference(prompts, GREEDY_TOKENS)
    params = [{"temperature": 0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True,
               "speculative_num_draft_tokens": b} for b in (None, 3, 8)]
    outs = smollm_dflash2.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == reference
    assert sum(o["meta_info"]["spec_source_steps"].get("dflash", 0) for o in outs) > 0


# ---------------------------------------------------------------- the engine, sampling (tiny target)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_setup(tmp_path_factory.mktemp("tiny2"),
                           lambda base: random_dflash2_model(dflash2_config(base, rank=4, top_k=4), seed=0, std=0.3))


@pytest.fixture(scope="module")
def dflash2_engine(tiny_dir: Path) -> Engine:
    engine = Engine(**engine_kwargs(tiny_dir), speculative_algorithm="DFLASH",
                    speculative_draft_model_path=str(tiny_dir / "draft"), speculative_adaptive=False,
                    speculative_lookup=True)
    yield engine
    engine.shutdown()


def exercised(metas: list[dict]) -> bool:
    hist = [sum(h) for h in zip(*(m["spec_accept_histogram"] for m in metas))]
    return sum(hist[:-1]) > 0.1 * sum(hist) and sum(hist[1:]) > 0.1 * sum(hist)


def test_tiny_greedy_dflash2_matches_ar(dflash2_engine: Engine, tiny_dir: Path):
    ar = Engine(**engine_kwargs(tiny_dir))
    prompts = [[1 + i % 7, 2, 3 + i % 5] for i in range(16)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    try:
        reference = [o["output_ids"] for o in ar.generate(input_ids=prompts, sampling_params=params)]
    finally:
        ar.shutdown()
    outs = dflash2_engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == reference
    metas = [o["meta_info"] for o in outs]
    assert exercised(metas) and steps(metas, "dflash") > 0.5 * sum(m["spec_verify_ct"] for m in metas)


def sample_mixed(engine: Engine, params: dict) -> dict[str, tuple[list[tuple[int, ...]], list[dict]]]:
    """NUM_SAMPLES 3-token samples of each prompt, interleaved in one call: PROMPT requests run DFlash 2 rows
    (no n-gram of theirs repeats), LOOKUP_PROMPT requests context-lookup rows, side by side in each batch."""
    prompts = [p for _ in range(NUM_SAMPLES) for p in (PROMPT, LOOKUP_PROMPT)]
    sp = [dict(params, max_new_tokens=3, seed=i, ignore_eos=True) for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    assert all(len(o["output_ids"]) == 3 for o in outs)
    return {name: ([tuple(o["output_ids"]) for o in outs[i::2]], [o["meta_info"] for o in outs[i::2]])
            for i, name in enumerate(("dflash", "lookup"))}


def steps(metas: list[dict], source: str) -> int:
    return sum(m.get("spec_source_steps", {}).get(source, 0) for m in metas)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_paths_keep_the_target_distribution(dflash2_engine: Engine, tiny_dir: Path, setting: str):
    """DFlash 2 rows sample their paths (sparse q), context-lookup rows propose point masses, in the same
    batches: each prompt's first 3 tokens follow its exact AR distribution."""
    params = SETTINGS[setting]
    for name, (samples, metas) in sample_mixed(dflash2_engine, params).items():
        total = sum(m["spec_verify_ct"] for m in metas)
        assert steps(metas, name) > 0.5 * total and exercised(metas), (name, total, steps(metas, name))
        prompt = PROMPT if name == "dflash" else LOOKUP_PROMPT
        assert chi_square_p_value(samples, exact_distribution(tiny_dir / "target", params, prompt)) > 1e-3


def mean_accept_length(metas: list[dict]) -> float:
    return sum(m["spec_accept_length"] for m in metas) / len(metas)


def test_q_raises_acceptance(dflash2_engine: Engine, monkeypatch: pytest.MonkeyPatch):
    """Treating sampled drafts as point masses is lossless too (accept with p(d)), but accepts less: the
    sparse rule accepts with min(p, q) >= p * q."""
    params = SETTINGS["T1"]
    _, metas = sample_mixed(dflash2_engine, params)["dflash"]
    real = accept_module.sparse_sampling_accept

    def point_mass_rule(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms, bonus_uniforms):
        ids, q = point_masses(candidates, draft_ids.shape[-1])
        return real(target_probs, candidates, block_lens, ids, q, uniforms, bonus_uniforms)

    monkeypatch.setattr(accept_module, "sparse_sampling_accept", point_mass_rule)
    _, point_metas = sample_mixed(dflash2_engine, params)["dflash"]
    assert mean_accept_length(metas) > 1.1 * mean_accept_length(point_metas)


def test_wrong_residual_fails(dflash2_engine: Engine, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """Wrong rule: after a rejection the bonus is drawn from p, not from max(p - q, 0): the test has power."""
    real = accept_module.sparse_sampling_accept

    def no_residual(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms, bonus_uniforms):
        accept_lens, _, out = real(target_probs, candidates, block_lens, draft_ids, draft_probs, uniforms,
                                   bonus_uniforms)
        rows = torch.arange(len(accept_lens))
        bonus = sample_from_probs(target_probs[rows, accept_lens], bonus_uniforms)
        out = out.clone()
        out[rows, accept_lens] = bonus
        return accept_lens, bonus, out

    monkeypatch.setattr(accept_module, "sparse_sampling_accept", no_residual)
    params = SETTINGS["T1"]
    samples, _ = sample_mixed(dflash2_engine, params)["dflash"]
    assert chi_square_p_value(samples, exact_distribution(tiny_dir / "target", params, PROMPT)) < 1e-8
