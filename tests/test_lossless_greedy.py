"""Greedy losslessness on SmolLM2-135M (or its random stand-in where the GGUF is absent: dflash_helpers.
target_model_path): 12 chat prompts x 128 new tokens in one batch, DFLASH == AR token for token (fp32) with a
random drafter and with an oracle drafter (exact AR continuation, seeded errors), at engine block sizes 2, 4, 16
and with request-level block sizes. In bf16, every emitted token is the argmax of the verify row that produced
it. Engines run on SGLANG_DFLASH_TEST_DEVICE (default cpu)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import assert_kv_clean
from dflash_helpers import (
    CHAT_PROMPTS,
    SMALL_POOL,
    OracleDrafter,
    ar_engine,
    ar_reference,
    chat_ids,
    device_engine,
    dflash_engine,
    target_model_path,
)

import sglang_dflash.speculative.dflash_step as dflash_step
from sglang_dflash import Engine
from sglang_dflash.device import HostCopy
from sglang_dflash.kernels.decode_attention import reads_runs
from sglang_dflash.models.packed_linear import bf16_kernel
from sglang_dflash.speculative.cost_model import CostModel

NEW_TOKENS = 128
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
BF16_TOKENS = 64  # enough for several verify blocks per request; bf16 greedy drifts from the fp32 oracle later


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return chat_ids(ar_engine(), CHAT_PROMPTS)


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    return ar_reference(prompts, NEW_TOKENS)


def vocab(engine: Engine) -> int:
    return engine.scheduler.worker.step.draft.config.vocab_size


def fixed_cost(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The engine's policy with a fixed step cost, as on a bandwidth-bound device (a step costs about the same
    whatever it verifies), not refit online: the plans these tests look at do not then depend on this machine's
    load (on a busy 2-core CI machine the online fit could price every lookup out)."""
    cost = CostModel({1: 0.010, 64: 0.012, 512: 0.030}, {16: 0.002, 512: 0.010})
    monkeypatch.setattr(cost, "observe", lambda *args: None)
    engine.scheduler.worker.step.policy.cost = cost
    return engine


def combined_histogram(outs: list[dict]) -> list[int]:
    hists = [o["meta_info"]["spec_accept_histogram"] for o in outs]
    return [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]


def test_random_drafter_matches_ar(prompts, reference):
    outs = dflash_engine(block=2).generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["spec_accept_length"] < 1.5 for o in outs)  # a random drafter is ~never right


@pytest.mark.parametrize("error_rate", [0.0, 0.1])
def test_oracle_drafter_matches_ar(prompts, reference, error_rate):
    engine = dflash_engine()
    with OracleDrafter(prompts, reference, vocab(engine), error_rate, seed=1).installed(engine.scheduler.worker):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    taus = [o["meta_info"]["spec_accept_length"] for o in outs]
    if error_rate == 0:
        assert min(taus) > 8, taus
    else:  # partial accepts and rollbacks at (almost) every block position
        hist = combined_histogram(outs)
        assert sum(n > 0 for n in hist) >= 12, hist
        assert 2 < sum(taus) / len(taus) < 12, taus


@pytest.mark.parametrize("error_rate", [0.3, 1.0])
def test_adaptive_blocks_and_lookup_match_ar(prompts, reference, error_rate, monkeypatch):
    """The defaults: per-step block sizes and proposal sources (DFlash from an oracle with errors, context
    lookup, plain rows) change from step to step; the output stays AR's, token for token. error_rate 1.0: a
    drafter that is always wrong, so the policy falls back to lookup and plain rows."""
    engine = fixed_cost(dflash_engine(adaptive=True), monkeypatch)
    with OracleDrafter(prompts, reference, vocab(engine), error_rate, seed=4).installed(engine.scheduler.worker):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    sources = defaultdict(int)
    for o in outs:
        for k, v in o["meta_info"]["spec_source_steps"].items():
            sources[k] += v
    sizes = {b for o in outs for b, n in enumerate(o["meta_info"]["spec_block_histogram"], 1) if n}
    assert sources["lookup"] > 0 and len(sizes) >= 3, (dict(sources), sizes)
    if error_rate < 1:
        assert sources["dflash"] > 0, dict(sources)
    else:
        assert sources["none"] > 0, dict(sources)


class LateCopy(HostCopy):
    """A host copy that lands late, as on a device still running steps: ready once LATE later copies were made
    (one per step)."""

    LATE = 2
    made = 0

    def __init__(self, tensor):
        super().__init__(tensor)
        LateCopy.made += 1
        self.index = LateCopy.made

    def ready(self) -> bool:
        return LateCopy.made - self.index >= self.LATE and super().ready()


def test_accepted_counts_that_land_late_match_ar(prompts, reference, monkeypatch):
    """The policy learns each step's accepted counts once their copy has landed, never waiting for it: when they
    land steps late (a device still running), the plans differ but the output is AR's, and only the last steps
    wait to be learnt."""
    monkeypatch.setattr(dflash_step, "HostCopy", LateCopy)
    engine = fixed_cost(dflash_engine(adaptive=True), monkeypatch)
    step = engine.scheduler.worker.step
    with OracleDrafter(prompts, reference, vocab(engine), 0.3, seed=4).installed(engine.scheduler.worker):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert 0 < len(step.unobserved) <= LateCopy.LATE + 1  # not landed at the last plan, and the last step


def test_request_level_block_sizes_match_ar(prompts, reference):
    engine = dflash_engine(block=4)  # engine-level 4, overridden per request in the same batch
    blocks = [None, 3, 8, 16] * 3
    params = [dict(GREEDY, speculative_num_draft_tokens=b) for b in blocks]
    with OracleDrafter(prompts, reference, vocab(engine), 0.1, seed=2).installed(engine.scheduler.worker):
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == reference
    for o, b in zip(outs, blocks):
        hist = o["meta_info"]["spec_accept_histogram"]
        assert len(hist) == (b or 4) and hist[-1] > 0, (b, hist)  # ran with its own block, fully accepted some


def test_bf16_matches_bf16_ar_with_the_cpu_kernels(prompts, reference, monkeypatch):
    """On a CPU with the bf16 linear kernel and the decode-attention kernel, every verified token is multiplied and
    attended exactly as a decode row (both kernels are batch-invariant per row; verify blocks attend as 1-token
    rows), so with --enable-deterministic-inference (our linear kernel at every batch size, also where oneDNN's
    AMX GEMM would be faster) bf16 DFLASH with the defaults (adaptive blocks, context lookup) equals bf16 AR token
    for token."""
    ar = device_engine(model_path=target_model_path(), dtype="bfloat16", max_total_tokens=SMALL_POOL,
                       enable_deterministic_inference=True)
    device = ar.scheduler.worker.model_runner.device
    if bf16_kernel() is None or not reads_runs(device):
        pytest.skip("needs the C++ bf16 linear and decode-attention kernels (a CPU with AVX512-BF16)")
    want = ar.generate(input_ids=prompts, sampling_params=GREEDY)
    engine = fixed_cost(dflash_engine("bfloat16", adaptive=True, enable_deterministic_inference=True), monkeypatch)
    with OracleDrafter(prompts, reference, vocab(engine), 0.1, seed=5).installed(engine.scheduler.worker):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    assert sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs) > 1.5  # blocks were verified


def test_bf16_emitted_tokens_are_verify_argmax(prompts, reference, monkeypatch):
    """bf16 verify rounds differently from 1-token decoding, so compare with the verify rows themselves."""
    engine = dflash_engine("bfloat16")
    worker = engine.scheduler.worker
    steps: dict[str, list[list[int]]] = defaultdict(list)
    mismatches = []
    accept = dflash_step.accept

    def checked_accept(block, logits, info, uniforms, draft=None):
        accept_lens, next_bonus, out_tokens = accept(block, logits, info, uniforms, draft)
        argmax = block.padded(logits.argmax(-1))
        for i, req in enumerate(worker.batch.reqs):
            n = int(accept_lens[i]) + 1
            tokens = out_tokens[i, :n].tolist()
            if tokens != argmax[i, :n].tolist():
                mismatches.append((req.rid, tokens, argmax[i, :n].tolist()))
            steps[req.rid].append(tokens)
        return accept_lens, next_bonus, out_tokens

    monkeypatch.setattr(dflash_step, "accept", checked_accept)
    with OracleDrafter(prompts, reference, vocab(engine), 0.1, seed=3).installed(worker):
        outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=BF16_TOKENS))
    assert not mismatches
    for o in outs:
        emitted = [t for step in steps[o["meta_info"]["id"]] for t in step]
        assert len(o["output_ids"]) == BF16_TOKENS
        assert o["output_ids"][1:] == emitted[: BF16_TOKENS - 1]  # token 0 comes from the prefill
    assert sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs) > 2  # long runs were verified


def staggered(engine: Engine, prompts: list[list[int]], every: int) -> tuple[list[list[int]], int]:
    """Runs the prompts arriving one every `every` steps (so prefills meet running requests); (outputs, steps that
    mixed a prefill with running requests)."""
    sched, tm = engine.scheduler, engine.tokenizer_manager
    mixed = []
    mix = sched.mix_with_running

    def counted(batch):
        out = mix(batch)
        mixed.append(len(out.reqs) > len(batch.reqs))
        return out

    sched.mix_with_running = counted
    reqs = [tm.make_req(None, p, GREEDY) for p in prompts]
    try:
        step = 0
        while step < every * len(reqs) or sched.has_work():
            if step % every == 0 and step // every < len(reqs):
                sched.add_request(reqs[step // every])
            sched.run_step()
            step += 1
    finally:
        del sched.mix_with_running
    return [r.output_ids for r in reqs], sum(mixed)


@pytest.mark.parametrize("algorithm", ["AR", "DFLASH"])
def test_mixed_chunks_match_ar(prompts, reference, algorithm, monkeypatch):
    """--enable-mixed-chunk: requests arrive while others decode, so their prefill steps also decode the running
    requests (one plain token each); the output is AR's token for token, and nothing leaks. DFLASH: adaptive, an
    oracle drafter with errors, lookup, so the running requests' blocks resume after each mixed step."""
    if algorithm == "AR":
        engine = device_engine(model_path=target_model_path(), dtype="float32", max_total_tokens=SMALL_POOL,
                               enable_mixed_chunk=True)
    else:
        engine = fixed_cost(dflash_engine(adaptive=True, enable_mixed_chunk=True), monkeypatch)
    with engine:
        if algorithm == "AR":
            outs, mixed = staggered(engine, prompts, every=5)
        else:
            with OracleDrafter(prompts, reference, vocab(engine), 0.3, seed=6).installed(engine.scheduler.worker):
                outs, mixed = staggered(engine, prompts, every=3)
        assert outs == reference
        assert mixed >= len(prompts) - 1
        assert_kv_clean(engine)
