"""Sampler units against naive references, and seeded sampling through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dflash.sampling.sampler import (
    FAST_K,
    SamplingBatchInfo,
    apply_penalties,
    logits_to_probs,
    penalty_state,
    sample,
    sample_from_probs,
)
from sglang_dflash.sampling.sampling_params import SamplingParams

VOCAB = 4 * FAST_K  # larger than the fast path's candidate set, so both paths are exercised


def naive_probs(row: list[float], p: SamplingParams) -> list[float]:
    """SGLang's order: softmax(logits / T); keep by rank < top_k, mass before the token <= top_p and
    prob >= min_p * max prob, all judged on the unfiltered probs; renormalise."""
    t = p.temperature if p.temperature > 0 else 1.0
    m = max(row)
    e = [math.exp((x - m) / t) for x in row]
    z = sum(e)
    probs = [x / z for x in e]
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    kept, before = [0.0] * len(row), 0.0
    for rank, i in enumerate(order):
        ok = (p.top_k < 1 or rank < p.top_k) and before <= p.top_p and probs[i] >= p.min_p * probs[order[0]]
        kept[i] = probs[i] if ok else 0.0
        before += probs[i]
    s = sum(kept)
    return [x / s for x in kept]


PARAM_ROWS = [
    ({}, "peaked"),
    ({"temperature": 0.7, "top_k": 5}, "peaked"),
    ({"top_p": 0.9}, "peaked"),
    ({"min_p": 0.1, "temperature": 1.3}, "peaked"),
    ({"top_k": 50, "top_p": 0.8, "min_p": 0.01}, "peaked"),
    ({"top_p": 0.95}, "flat"),  # the kept set spills past the fast path's candidates
    ({"top_k": 2 * FAST_K}, "flat"),
    ({"min_p": 0.5, "temperature": 2.0}, "flat"),
]


def test_logits_to_probs_matches_naive():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams.from_dict({"temperature": 1.0, **d}) for d, _ in PARAM_ROWS]
    rows = [torch.randn(VOCAB, generator=g) * (3.0 if kind == "peaked" else 0.3) for _, kind in PARAM_ROWS]
    logits = torch.stack(rows)
    got = logits_to_probs(logits, SamplingBatchInfo.from_params(params, VOCAB, torch.device("cpu")))
    for i, p in enumerate(params):
        want = torch.tensor(naive_probs(logits[i].tolist(), p), dtype=torch.float64)
        assert torch.allclose(got[i].double(), want, atol=1e-6), PARAM_ROWS[i]
        assert ((got[i] > 0) == (want > 0)).all(), PARAM_ROWS[i]


def test_sample_from_probs_is_inverse_cdf():
    probs = torch.tensor([[0.2, 0.5, 0.0, 0.3]]).expand(6, -1)
    u = torch.tensor([0.0, 0.19, 0.21, 0.69, 0.71, 0.9999])
    assert sample_from_probs(probs, u).tolist() == [0, 0, 1, 1, 3, 3]
    # and the draws follow the distribution
    many = sample_from_probs(probs[:1].expand(20000, -1), torch.rand(20000, generator=torch.Generator().manual_seed(1)))
    freq = torch.bincount(many, minlength=4).double() / 20000
    assert torch.allclose(freq, probs[0].double(), atol=0.015) and freq[2] == 0


def test_penalties_match_naive():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 12, generator=g)
    params = [
        SamplingParams.from_dict({"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.25}),
        SamplingParams.from_dict({}),
    ]
    outputs, prompts = [[3, 3, 5], [1]], [[7, 5], [2]]
    info = SamplingBatchInfo.from_params(params, 12, torch.device("cpu"))
    counts, seen = penalty_state(outputs, prompts, 12, torch.device("cpu"))
    got = apply_penalties(logits, info, counts, seen)
    want = logits.clone()
    p = params[0]
    for t in range(12):
        x = want[0, t].item()
        if t in outputs[0] or t in prompts[0]:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        n = outputs[0].count(t)
        want[0, t] = x - p.frequency_penalty * n - p.presence_penalty * (n > 0)
    assert torch.allclose(got, want, atol=1e-6)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams.from_dict(d) for d in ({"temperature": 0}, {"temperature": 1.0}, {"top_k": 1})]
    info = SamplingBatchInfo.from_params(params, VOCAB, torch.device("cpu"))
    out = sample(logits, info, torch.rand(3))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


# ---- through the engine ----
PROMPT = "Write one sentence about a cat."


def gen(engine, **params) -> list[int]:
    return engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, **params})["output_ids"]


def test_seed_fixes_the_output(engine, greedy, kv_clean):
    a = gen(engine, seed=7)
    assert gen(engine, seed=7) == a
    # the same seeded request inside a batch of other requests draws the same tokens
    batch = engine.generate(
        [PROMPT, "Hello there", PROMPT],
        [{"max_new_tokens": 12, "temperature": 1.0, "seed": s} for s in (1, 2, 7)],
    )
    assert batch[2]["output_ids"] == a
    assert len({tuple(gen(engine, seed=s)) for s in (11, 12, 13)} | {tuple(a)}) >= 3
    kv_clean(engine)


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_that_keep_one_token_equal_greedy(engine, params, kv_clean):
    assert gen(engine, seed=3, **params) == gen(engine, temperature=0)
    kv_clean(engine)


def test_penalties_change_behaviour(engine, kv_clean):
    prompt = "I like apples. I like apples. I like"
    params = {"max_new_tokens": 20, "temperature": 0}
    base = engine.generate(prompt, params)["output_ids"]
    assert len(set(base)) < len(base) // 2  # greedy falls into a loop
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = engine.generate(prompt, {**params, **penalty})["output_ids"]
        assert len(set(out)) > 2 * len(set(base)), penalty
    ids = engine.tokenizer_manager.encode(prompt)
    out = engine.generate(prompt, {**params, "repetition_penalty": 1e4})["output_ids"]
    assert len(set(out)) == len(out) and not set(out) & set(ids)  # nothing seen before is chosen again
    kv_clean(engine)


def test_logits_to_probs_of_strided_rows_match_naive():
    """Verify rows come as a view of the verify logits: strided rows give the same distributions."""
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams.from_dict(d) for d in
              ({"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 7}, {"temperature": 1.2})]
    wide = torch.randn(len(params), 2 * VOCAB, generator=g) * 2.0
    logits = wide[:, ::2]  # strided rows
    got = logits_to_probs(logits, SamplingBatchInfo.from_params(params, VOCAB, torch.device("cpu")))
    for i, p in enumerate(params):
        want = torch.tensor(naive_probs(logits[i].tolist(), p), dtype=torch.float64)
        assert torch.allclose(got[i].double(), want, atol=1e-6), p
