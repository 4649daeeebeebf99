"""The adaptive speculation policy's parts: the n-gram index against a brute-force search, the cost model,
and block-size choices that follow acceptance and cost."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sglang_dflash.speculative.cost_model import LOWER_BOUNDS, CostModel, Curve, _bounded_solve, load_or_calibrate
from sglang_dflash.speculative.lookup import NgramIndex
from sglang_dflash.speculative.policy import (
    CHECK_EVERY,
    DFLASH,
    EXPLORE_BUDGET,
    EXPLORE_EVERY,
    EXPLORE_JOIN,
    EXPLORE_SLOWEST,
    LOOKUP,
    LOOKUP_PRIOR,
    MATERIALISE_OFF_AFTER,
    NONE,
    PLAIN_SKIP,
    PRIOR_ESTIMATORS,
    Plan,
    SpecOptions,
    SpecPolicy,
)


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """Longest suffix n-gram with an earlier occurrence (the latest one); its next k tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k], n
    return [], 0


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_matches_brute_force(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    index = NgramIndex(2, 4)
    output: list[int] = []
    for _ in range(60):
        output.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))  # a step commits 1..3 tokens
        index.sync(prompt, output)
        assert index.propose(7) == brute_force_lookup(prompt + output, 2, 4, 7)


def test_ngram_index_restarts_after_retraction():
    index = NgramIndex(2, 3)
    index.sync([1, 2, 3], [1, 2, 3, 1])
    index.sync([1, 2, 3], [4])  # the outputs were recomputed: history shrank
    assert index.tokens == [1, 2, 3, 4] and index.propose(4) == ([], 0)


def test_cost_model_is_monotone_and_interpolates():
    cost = CostModel({1: 0.05, 2: 0.04, 4: 0.06, 8: 0.10}, {16: 0.01, 32: 0.03})
    times = [cost.step_time(n, 0, 1) for n in range(1, 20)]
    assert times == sorted(times) and times[0] == pytest.approx(0.04)  # the 2-token forward bounds the 1-token one
    assert cost.step_time(6, 0, 1) == pytest.approx(0.08)  # halfway between 4 and 8
    assert cost.step_time(16, 16, 1) == pytest.approx(cost.step_time(16, 0, 1) + 0.01)
    flat = CostModel({1: 0.05, 16: 0.05, 64: 0.1}, {16: 0.01})  # CPU-like: flat up to 16 verify tokens
    for requests, tokens in ((4, 4), (4, 8), (8, 16), (4, 12)) * 10:
        # measured: twice the calibration plus 5 ms per speculative verify token
        flat.observe(tokens, 0, requests, 2 * flat.calibrated(tokens, 0) + 0.005 * (tokens - requests))
    assert flat.step_time(4, 0, 4) < flat.step_time(16, 0, 4)
    a, _, _, e, _, _ = flat.coef_at(4)  # the prior a = 1, e = 0 fades
    assert 1.7 < a < 2.3 and 0.003 < e < 0.007
    assert flat.step_time(16, 0, 4) == pytest.approx(2 * 0.05 + 0.005 * 12, rel=0.05)


def test_cost_model_fits_the_same_read_late_or_every_step():
    """Observed steps are folded into the fit when a fit is read: the same sums, to rounding, as folding each
    step at once (the newest weighing most)."""
    rng = random.Random(3)
    steps = [(r + rng.randrange(0, 20), rng.choice((0, 16, 32)), r, rng.uniform(0.02, 0.2))
             for r in (rng.randrange(1, 33) for _ in range(300))]
    every, late = (CostModel({1: 0.05, 16: 0.06, 64: 0.1}, {16: 0.01, 64: 0.03}) for _ in range(2))
    for step in steps:
        every.observe(*step)
        every.coef_at(16)  # read every step
        late.observe(*step)
    np.testing.assert_allclose(late.coef_at(16), every.coef_at(16), rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(late.seen, every.seen)
    np.testing.assert_allclose(late.sums_xx, every.sums_xx, rtol=1e-9)
    np.testing.assert_allclose(late.sums_xy, every.sums_xy, rtol=1e-9)


def test_cost_model_learns_the_tile_step_of_a_real_batch():
    """At 32 requests the first speculative token starts a 16-row GEMM tile and costs more than the one-request
    calibration says (measured on CPU: +9% of the step); the fit learns that step, and no step where no tile
    starts (20 requests, a few more tokens)."""
    cost = CostModel({1: 0.05, 16: 0.05, 17: 0.052, 32: 0.055, 33: 0.058, 64: 0.07}, {16: 0.01})
    rng = np.random.default_rng(0)

    def measured(tokens: int, requests: int) -> float:
        tiles = -(-tokens // 16) - -(-requests // 16)
        return 2 * cost.calibrated(tokens, 0) + 0.001 * (tokens - requests) + 0.012 * tiles

    for _ in range(300):
        requests = int(rng.choice([20, 32]))
        tokens = requests + int(rng.choice([0, 0, 1, 3, 8, 16]))
        cost.observe(tokens, 0, requests, measured(tokens, requests))
    for requests, tokens in ((32, 33), (32, 40), (20, 23), (20, 36)):
        assert cost.step_time(tokens, 0, requests) == pytest.approx(measured(tokens, requests), rel=0.02)
    jump = cost.step_time(33, 0, 32) - cost.step_time(32, 0, 32)
    assert jump == pytest.approx(measured(33, 32) - measured(32, 32), rel=0.1) and cost.coef_at(32)[4] > 0.006


def test_cost_model_fits_each_batch_size_from_steps_of_about_its_size():
    """A CPU batch of 16 is compute-bound (each request and speculative token costs real time beyond the one-request
    calibration) where a batch of 1 streams weights (the calibration holds, a little slower): fitted from steps of
    both, each is predicted from its own (before, one fit across sizes priced the last requests of a batch at
    full-batch costs and they stopped speculating)."""
    cost = CostModel({1: 0.0128, 8: 0.014, 16: 0.0174, 24: 0.023, 32: 0.029}, {16: 0.003})
    rng = np.random.default_rng(1)

    def measured(tokens: int, requests: int) -> float:
        if requests >= 8:
            return cost.calibrated(tokens, 0) + 0.00075 * requests + 0.0006 * (tokens - requests)
        return 1.1 * cost.calibrated(tokens, 0)

    for _ in range(300):
        requests = int(rng.choice([1, 12, 14, 16, 16, 16]))
        tokens = requests + int(rng.choice([0, 0, 0, 8]))
        cost.observe(tokens, 0, requests, measured(tokens, requests))
    for requests, tokens in ((1, 1), (1, 9), (16, 16), (16, 24), (14, 22)):
        assert cost.step_time(tokens, 0, requests) == pytest.approx(measured(tokens, requests), rel=0.03)


def test_cost_model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_CACHE", str(tmp_path))
    calls = []

    def run():
        calls.append(1)
        return CostModel({1: 1.0, 2: 2.0}, {16: 1.0})

    a = load_or_calibrate({"device": "cpu"}, run)
    b = load_or_calibrate({"device": "cpu"}, run)
    assert len(calls) == 1 and a.to_dict() == b.to_dict()
    load_or_calibrate({"device": "cpu"}, run, check=lambda: {1: 1.1, 2: 1.8})  # the probe agrees: kept
    assert len(calls) == 1
    load_or_calibrate({"device": "cpu"}, run, check=lambda: {1: 2.5, 2: 4.0})  # a slower machine: redone
    assert len(calls) == 2


def flat_cost() -> CostModel:
    """A CPU-like step: verify cost flat to 16 tokens then linear; a draft forward costs a quarter step."""
    return CostModel({1: 1.0, 16: 1.1, 64: 2.0, 256: 6.0}, {16: 0.25, 256: 1.0})


def test_curve_tabulates_the_piecewise_linear_times():
    """Curve (a table at whole token counts, grown on demand) against the piecewise-linear definition: flat below
    the first point, linear between points and past the last; no tokens cost nothing."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        xs = np.unique(rng.integers(1, 3000, size=rng.integers(1, 8)))
        ys = np.sort(rng.random(len(xs)))  # monotone already
        curve = Curve(dict(zip(xs.tolist(), ys.tolist())))
        n = rng.integers(0, 5000, size=50)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        want = np.where(n > xs[-1], ys[-1] + slope * (n - xs[-1]), np.interp(n, xs, ys))
        want[n == 0] = 0.0
        np.testing.assert_allclose(curve(n), want, rtol=1e-12)
        assert curve(int(n[0])) == pytest.approx(want[0])


def reference_best(policy: SpecPolicy, look: np.ndarray, draft: np.ndarray | None) -> list[int]:
    """The block lengths of the best plan, spelled out: each row takes the source promising more in all, then the
    extensions of all rows in order of gain are taken while they raise expected tokens per second."""
    bs = len(look)
    drafting = [draft is not None and draft[i].sum() > look[i].sum() for i in range(bs)]
    gains = [draft[i] if drafting[i] else look[i] for i in range(bs)]
    exts = sorted((-g, i, k) for i in range(bs) for k, g in enumerate(gains[i]) if g > 0)
    best_rate, best_lens = bs / policy.cost.step_time(bs, 0, bs), [1] * bs
    lens, expected = [1] * bs, float(bs)
    for neg_gain, i, _ in exts:
        lens[i] += 1
        expected -= neg_gain
        widths = [n for n, d in zip(lens, drafting) if d and n > 1]
        rate = expected / policy.cost.step_time(sum(lens), len(widths) * max(widths, default=0), bs)
        if rate > best_rate:
            best_rate, best_lens = rate, list(lens)
    return best_lens


def test_batched_plan_matches_the_spelled_out_one():
    cost = CostModel({1: 0.02, 8: 0.022, 9: 0.026, 16: 0.03, 17: 0.033, 32: 0.04, 33: 0.045, 64: 0.07, 256: 0.25},
                     {16: 0.004, 64: 0.01, 256: 0.03})
    rng = np.random.default_rng(5)
    for _ in range(200):
        bs = int(rng.integers(1, 40))
        policy = SpecPolicy(SpecOptions(16), cost)
        states = [policy.new_state() for _ in range(bs)]
        for st in states:
            for key in st.accept:
                st.accept[key] = (rng.random(15) ** 0.4).tolist()
        match = [int(rng.choice([0, 2, 3, 4])) for _ in range(bs)]
        lookups = [(rng.integers(0, 9, size=int(rng.integers(1, 16))).tolist(), n) if n else ([], 0) for n in match]
        limits = rng.integers(1, 17, size=bs).tolist()
        look = policy.gain_matrix(states, [f"{LOOKUP}{n}" if n else None for _, n in lookups],
                                  [len(t) for t, _ in lookups])
        draft = policy.gain_matrix(states, [DFLASH] * bs, [lim - 1 for lim in limits])
        for d in (None, draft):
            _, seconds, plans = policy._best(lookups, look, d)
            assert [p.block_len for p in plans] == reference_best(policy, look, d)
            assert seconds == pytest.approx(policy._step_time(plans))
            for p, (toks, n) in zip(plans, lookups):
                assert p.source != LOOKUP or (p.lookup_tokens == toks[: p.block_len - 1] and p.match_n == n)


def test_policy_drops_a_useless_drafter_to_plain_decoding():
    """Within 40 steps (the DFlash prior starts as 16 outcomes at 0.5; a verify token is nearly free here)."""
    policy = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    state = policy.new_state()
    for _ in range(40):
        plans = policy.plan([state], None, [16])
        policy.observe([state], plans, [0])
    assert plans[0].source == NONE and plans[0].block_len == 1


def test_plain_batches_are_planned_rarely():
    """Once plain rows win for the whole batch, up to PLAIN_SKIP steps in a row run them unplanned; a drafter
    that starts to accept is taken again within PLAIN_SKIP + 1 steps."""
    policy = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    states = [policy.new_state() for _ in range(8)]
    plans_made = []
    best = policy._best
    policy._best = lambda *args: plans_made.append(1) or best(*args)
    for _ in range(600):
        plans = policy.plan(states, None, [16] * 8)
        policy.observe(states, plans, [0] * 8)
    assert all(p.source == NONE for p in plans)
    assert len(plans_made) / 2 <= 600 / (PLAIN_SKIP + 1) + 30  # two candidate plans (with, without a draft) each
    for st in states:  # the drafter turns out to accept everything
        st.accept[DFLASH] = [0.99] * 15
    policy.prior[DFLASH] = [0.99] * 15
    taken = [any(p.source == DFLASH for p in policy.plan(states, None, [16] * 8)) for _ in range(PLAIN_SKIP + 1)]
    assert any(taken)


def test_policy_takes_long_blocks_from_an_accepting_drafter():
    """Within 40 steps."""
    policy = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    state = policy.new_state()
    for _ in range(40):
        plans = policy.plan([state], None, [16])
        policy.observe([state], plans, [plans[0].block_len - 1])  # every draft accepted
    assert plans[0].source == DFLASH and plans[0].block_len == 16


def test_policy_prefers_a_matching_lookup_and_shrinks_blocks_under_load():
    policy = SpecPolicy(SpecOptions(16), flat_cost())
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    plans = policy.plan([policy.new_state()], [(prompt, [3])], [16])  # ... 2, 3 repeats: continue 4, 5, ...
    assert plans[0].source == LOOKUP and plans[0].lookup_tokens == [4, 5, 6, 7, 8, 9, 1, 2, 3][: plans[0].block_len - 1]
    alone = policy.plan([policy.new_state()], None, [16])[0].block_len
    crowd = policy.plan([policy.new_state() for _ in range(48)], None, [16] * 48)
    assert max(p.block_len for p in crowd) < alone  # 48 requests: verify tokens are no longer free


def test_exploration_is_shared_by_the_batch():
    """A useless drafter in a batch of 32 requests at staggered ages: the requests re-try DFlash in shared draft
    forwards, never one draft forward per request, and ever more rarely (the shared prior learns it is useless),
    down to once per EXPLORE_SLOWEST * EXPLORE_EVERY steps."""
    policy = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    states = [policy.new_state() for _ in range(32)]
    for i, st in enumerate(states):
        st.since_dflash = 2 * i  # arrived at different times
    draft_steps, explored, steps = 0, [0] * 32, 4 * EXPLORE_SLOWEST * EXPLORE_EVERY
    for _ in range(steps):
        plans = policy.plan(states, None, [16] * 32)
        draft_steps += any(p.source == DFLASH for p in plans)
        for i, p in enumerate(plans):
            explored[i] += p.source == DFLASH
        policy.observe(states, plans, [0] * 32)
    assert draft_steps <= steps // (EXPLORE_SLOWEST * EXPLORE_JOIN) + 4
    assert min(explored) >= steps // (EXPLORE_SLOWEST * EXPLORE_EVERY)  # every request still re-tries DFlash


def test_lookup_estimates_follow_the_match_length():
    """2-gram matches that never continue and 4-gram matches that always do: after a few steps the request
    still verifies 4-gram continuations but no longer 2-gram ones (it drafts or decodes plainly there)."""
    policy = SpecPolicy(SpecOptions(16, lookup_min_n=2, lookup_max_n=4), flat_cost())
    state = policy.new_state()
    two = ([5, 6, 7, 1, 2, 9, 9, 9], [1, 2])  # suffix (1, 2) seen before: a 2-gram match
    four = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [4])  # suffix (1, 2, 3, 4): a 4-gram match
    for _ in range(15):
        for history, accepted in ((two, 0), (four, None)):
            state.index.__init__(2, 4)  # each history on its own
            plan = policy.plan([state], [history], [16])[0]
            if plan.source == LOOKUP:
                policy.observe([state], [plan], [plan.block_len - 1 if accepted is None else accepted])
    state.index.__init__(2, 4)
    assert policy.plan([state], [four], [16])[0].source == LOOKUP
    state.index.__init__(2, 4)
    assert policy.plan([state], [two], [16])[0].source != LOOKUP
    assert state.accept["lookup2"][0] < LOOKUP_PRIOR[2] and state.accept["lookup4"][0] > 0.9


def test_lookup_estimates_learn_from_proposals_not_verified():
    """Where speculation does not pay (every verify token costs a decode row), lookup proposals are not verified, yet
    the request's and the shared estimates learn from them once the tokens they predicted are committed: up where
    the text went on as proposed, down where it did not; a proposal the plan verifies is learnt from once."""
    dear = CostModel({1: 1.0, 2: 2.0, 16: 16.0, 64: 64.0}, {16: 10.0})
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # the bonus 4 ends the 4-gram (1, 2, 3, 4): propose 5, 6, 7

    def after(output: list[int]) -> tuple[float, float]:
        policy = SpecPolicy(SpecOptions(4), dear)
        state = policy.new_state()
        assert policy.plan([state], [(prompt, [4])], [4])[0].source == NONE and state.shadow is not None
        for _ in range(PLAIN_SKIP + 1):  # the next planned step reads the committed tokens
            policy.plan([state], [(prompt, output)], [4])
        return state.accept["lookup4"][0], policy.prior["lookup4"][0]

    start = LOOKUP_PRIOR.get(4, 0.8)
    hit, miss = after([4, 5, 6, 7]), after([4, 9])
    assert hit[0] > start and hit[1] > start and miss[0] < start and miss[1] < start
    assert after([4, 5, 6]) == (start, start)  # 5, 6 as proposed, 7 not yet known: no outcome yet
    policy = SpecPolicy(SpecOptions(4), flat_cost())  # cheap verify tokens: the proposal is verified, no shadow
    state = policy.new_state()
    plan = policy.plan([state], [(prompt, [4])], [4])[0]
    assert plan.source == LOOKUP and state.shadow is None


def test_gains_are_scaled_by_what_proposals_realised():
    """Proposals that keep realising half of what their estimates promised have their gains halved (for every
    request: the ratio is shared); a source that realises what it promised keeps its gains."""
    policy = SpecPolicy(SpecOptions(16), flat_cost())
    states = [policy.new_state() for _ in range(4)]
    fresh = policy.new_state()
    for _ in range(300):
        for st in states:
            st.accept["lookup3"] = [0.8] * 15  # an estimate that stays optimistic
            st.accept["lookup4"] = [1.0] * 15
        plans = [Plan(LOOKUP, 5, [1, 2, 3, 4], 3), Plan(LOOKUP, 5, [1, 2, 3, 4], 4)] * 2
        expected3 = sum(policy.gains(states[0], "lookup3", 4))
        policy.observe(states, plans, [1, 4, 1, 4])  # lookup3 realises ~1 of the ~2.4 expected
    fresh.accept["lookup3"], fresh.accept["lookup4"] = [0.8] * 15, [1.0] * 15
    ratio = sum(policy.gains(fresh, "lookup3", 4)) / sum(0.8**k for k in range(1, 5))
    assert ratio == pytest.approx(1 / 2.3616, rel=0.05) and expected3 == pytest.approx(1.0, rel=0.05)
    assert policy.gains(fresh, "lookup4", 4) == pytest.approx([1.0] * 4, rel=0.02)
    for _ in range(600):  # no lookup3 proposal verified for a while: the ratio returns to 1, lookup3 is tried again
        policy.observe(states, [Plan(NONE, 1)] * 4, [0] * 4)
    assert sum(policy.gains(fresh, "lookup3", 4)) / sum(0.8**k for k in range(1, 5)) == pytest.approx(1, rel=0.02)


@pytest.mark.parametrize("seed", range(4))
def test_cost_model_fit_is_the_bounded_least_squares_optimum(seed: int):
    """The online refit against a brute-force search: random problems (as many features as the cost model has)
    whose free solution breaks the bounds; the warm-started answer equals the best of every bounded fit, and no
    feasible point beats it."""
    rng = np.random.default_rng(seed)
    k = len(LOWER_BOUNDS)
    held = (False,) * k
    for _ in range(30):
        x = rng.normal(size=(12, k))
        x[:, 3] = x[:, 2] + 0.05 * rng.normal(size=12)  # nearly collinear, like b and e
        y = x @ rng.normal(0, 1, k) + 0.1 * rng.normal(size=12)
        xx, xy = x.T @ x, x.T @ y
        coef, held = _bounded_solve(xx, xy, LOWER_BOUNDS, held)
        assert (coef >= LOWER_BOUNDS).all()

        def loss(c, xx=xx, xy=xy):
            return c @ xx @ c - 2 * c @ xy

        cold, _ = _bounded_solve(xx, xy, LOWER_BOUNDS, (True, False) * (k // 2) + (True,) * (k % 2))
        assert loss(coef) == pytest.approx(loss(cold), rel=1e-9, abs=1e-9)
        for _ in range(200):  # feasible perturbations never do better
            trial = np.maximum(coef + rng.normal(0, 0.05, k), LOWER_BOUNDS)
            assert loss(trial) >= loss(coef) - 1e-9


def test_exploration_spends_at_most_its_budget():
    """Where an exploring step is dear (32 requests on a CPU-like cost: the 33rd verify token steps the cost
    up, and 32 exploring rows triple the step), the batch still re-tries DFlash, within EXPLORE_BUDGET of the
    predicted time (plus the credit one may save up)."""
    cost = CostModel({1: 1.0, 32: 1.0, 33: 1.5, 128: 2.0}, {16: 0.5, 128: 1.0})
    policy = SpecPolicy(SpecOptions(16, lookup=False), cost)
    states = [policy.new_state() for _ in range(32)]
    spent = total = 0.0
    exploring_steps = 0
    for _ in range(1000):
        plans = policy.plan(states, None, [16] * 32)
        plain = [Plan(NONE, 1) if p.source == DFLASH else p for p in plans]
        total += policy._step_time(plans)
        if any(p.source == DFLASH for p in plans):
            exploring_steps += 1
            spent += policy._step_time(plans) - policy._step_time(plain)
        policy.observe(states, plans, [1 if p.source == DFLASH else 0 for p in plans])  # 1 of 3 drafts accepted
    assert exploring_steps >= 3
    saved_up = EXPLORE_BUDGET * EXPLORE_EVERY * EXPLORE_SLOWEST * cost.step_time(32, 0, 32)
    assert spent <= EXPLORE_BUDGET * total + saved_up


def test_marginal_speculation_keeps_measuring_plain_steps():
    """A compute-bound step (a verify token costs nearly a decode row) and a drafter whose drafts are all accepted:
    at 32 requests the best plan promises ~1.1x the plain rows' rate, so one step in CHECK_EVERY runs plain rows
    (the cost model keeps measuring what it compares against); one request, whose long blocks pay ~10x, never
    does."""
    for bs, want_plain in ((32, True), (1, False)):
        policy = SpecPolicy(SpecOptions(16, lookup=False), CostModel({1: 1.0, 32: 10.0, 64: 18.0, 512: 140.0},
                                                                     {16: 0.1, 512: 1.0}))
        policy.prior[DFLASH] = [0.99] * 15
        policy.prior_counts[DFLASH] = PRIOR_ESTIMATORS[DFLASH].counts(policy.prior[DFLASH])
        states = [policy.new_state() for _ in range(bs)]
        plain_steps = []
        for step in range(4 * CHECK_EVERY):
            plans = policy.plan(states, None, [16] * bs)
            if all(p.source == NONE for p in plans):
                plain_steps.append(step)
            policy.observe(states, plans, [p.block_len - 1 for p in plans])
        if want_plain:
            assert plain_steps == list(range(CHECK_EVERY - 1, 4 * CHECK_EVERY, CHECK_EVERY))
        else:
            assert plain_steps == [] and plans[0].block_len == 16


def test_materialisation_stops_where_no_dflash_block_could_pay():
    """A CPU-like cost: alone, a DFlash block pays and the draft context stays materialised; at 32 requests none
    could (a verify token costs nearly a decode row), so after MATERIALISE_OFF_AFTER plans materialisation stops,
    and requests that no longer draft are never planned DFlash, not even to explore."""
    alone = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    for _ in range(3 * MATERIALISE_OFF_AFTER):
        alone._decide_materialise(1, 16)
    assert alone.materialise
    crowd = SpecPolicy(SpecOptions(16, lookup=False), flat_cost())
    ons = []
    for _ in range(3 * MATERIALISE_OFF_AFTER):
        crowd._decide_materialise(32, 16)
        ons.append(crowd.materialise)
    assert ons == [True] * (MATERIALISE_OFF_AFTER - 1) + [False] * (2 * MATERIALISE_OFF_AFTER + 1)
    crowd._decide_materialise(32, 1)  # blocks of 1 never pay either
    assert not crowd.materialise
    states = [crowd.new_state() for _ in range(32)]
    for st in states:
        st.drafts, st.since_dflash = False, 10 * EXPLORE_SLOWEST * EXPLORE_EVERY
        st.accept[DFLASH] = [0.99] * 15
    crowd.skip = 0
    for _ in range(4 * EXPLORE_JOIN):
        assert all(p.source != DFLASH for p in crowd.plan(states, None, [16] * 32))


def test_a_few_misses_do_not_stop_a_paying_drafter():
    """Batch 1 with this CPU's calibrated costs (a block of 4 verifies in ~1.04 plain steps, a draft forward ~0.25)
    and a drafter accepting each draft with probability 0.36 (the shipped drafter's rate on HumanEval): blocks pay
    (~1.49 tokens a step for ~1.29 plain steps), so DFlash stays planned on most steps. With estimates that follow a
    request's last outcomes, runs of misses stopped it until it was explored again (10% of steps)."""
    cost = CostModel({1: 14.4, 2: 14.8, 4: 14.9, 8: 16.2, 16: 23.5, 32: 34.0}, {16: 3.66, 64: 8.0})
    rng = np.random.default_rng(0)
    drafting = 0
    policy = SpecPolicy(SpecOptions(16, lookup=False), cost)
    for _ in range(8):  # requests one after another, 128 steps each
        state = policy.new_state()
        for _ in range(128):
            plan = policy.plan([state], None, [16])[0]
            accepted = 0
            while accepted < plan.block_len - 1 and rng.random() < 0.36:
                accepted += 1
            policy.observe([state], [plan], [accepted])
            drafting += plan.source == DFLASH
    assert drafting >= 0.8 * 8 * 128
