"""Adaptive speculation: per request and step, which proposer and how many tokens to verify.

Each request keeps a running estimate of the conditional acceptance at every block position for each
source (DFlash; context lookup per suffix-match length n, since a 4-gram match continues far more often than
a 2-gram one), starting from a prior shared by all requests (learnt from all of them), and learnt from every lookup
proposal, verified or not (one not verified is scored against the tokens committed after it). A lookup's estimate
follows the request's recent outcomes alone (copying comes in bursts); DFlash's stays near the shared prior (its
~20 latest outcomes weigh as 64 at the prior), and the DFlash prior counts its last few hundred verified outcomes
(`REQUEST_ESTIMATORS`, `PRIOR_ESTIMATORS`): its outcomes are noisy per step, so a few misses could push a quickly
moving estimate under the drafter's rate, the request stopped drafting and nothing corrected it; a
request that has not tried DFlash for EXPLORE_EVERY steps tries a short block, so the estimates follow the
text, and every request that has not for EXPLORE_JOIN steps joins it: a batch pays for one exploring draft
forward every ~EXPLORE_JOIN steps, not one per request (up to EXPLORE_SLOWEST times rarer while the prior says
DFlash's first draft is seldom accepted, and never more than EXPLORE_BUDGET of the predicted time: at 32
requests on a CPU an exploring step costs ~1.7 plain ones). Extending request i's block from b to b + 1 tokens adds
prod_{k<=b} p_ik expected committed tokens; a step's cost comes from a cost model of the verify tokens
and the draft forward (`CostModel`). The plan takes the expected-gain-sorted extensions while they raise
expected tokens per second, for a batch with and without a draft forward, and keeps the better one.
B = 1 is a plain decode row: a request whose proposals do not pay costs what plain decoding costs. Where the best
plan promises little over plain rows, one step in CHECK_EVERY runs plain rows, so the cost model's online fit keeps
measuring the step it compares against. Where plain rows win for the whole batch (a loaded CPU: a verify token costs
nearly what a decode row does), the next steps run plain rows unplanned, 1 after the first such plan and up to
PLAIN_SKIP after PLAIN_SKIP in a row: the decision costs what a plain step costs too (~1.5% at 32 requests).
Where no DFlash block could pay at the batch's size even with the acceptance credited at least MATERIALISE_FLOOR (a
loaded CPU), the draft's context K/V stops being materialised (`materialise`): the requests then running or
prefilled stop drafting (`ReqSpecState.drafts`; lookup and plain rows remain) until it pays again, when the step
writes the context it parked meanwhile (`DFlashStep.resume`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang_dflash.speculative.cost_model import CostModel
from sglang_dflash.speculative.lookup import NgramIndex

DFLASH, LOOKUP, NONE = "dflash", "lookup", "none"
EXPLORE_EVERY = 64  # a request that has not tried DFlash for this many steps tries a short block ...
EXPLORE_JOIN = 32  # ... and so does every request that has not for this many (or whenever a draft forward runs)
EXPLORE_BLOCK = 4
EXPLORE_PRIOR = 0.3  # below this first-position acceptance of DFlash in the shared prior, exploring slows down ...
EXPLORE_SLOWEST = 8  # ... to at most this many times less often (a useless drafter is then nearly never retried)
EXPLORE_BUDGET = 0.01  # exploring steps may add at most this share of the predicted decode time (a batch of 32
# exploring rows costs ~70% of a step on a 2-core CPU: every 32 steps that would be 2%)
REALISED_DECAY = 0.99  # per verified lookup proposal, in the shared ratio of accepted to expected drafts per key
REALISED_PRIOR = 2.0  # drafts the ratio starts from (as if 2 expected drafts had been accepted) ...
REALISED_RELAX = 0.98  # ... and is pulled back to, this much per verified step (every lookup key; while a key is
# verified its outcomes outweigh the pull): one that failed where it was tried gets tried again (at 32 requests all
# starting at once, 4-gram lookups of the chat template's code fence failed together and, without the pull, the ratio
# kept every later 4-gram lookup out)
CHECK_EVERY = 16  # a batch whose best plan promises under CHECK_GAIN x the plain rows' rate runs plain rows ...
CHECK_GAIN = 1.25  # ... once in this many steps, so the cost model keeps measuring what it compares against
PLAIN_SKIP = 8  # at most this many unplanned plain steps after plans of plain rows only
MATERIALISE_FLOOR = 0.5  # the acceptance at every block position DFlash is credited with at least in that decision
MATERIALISE_OFF_AFTER = 8  # plans in a row in which no DFlash block could pay before materialisation stops
PAYS_EVERY = 16  # plans between evaluations of whether a DFlash block could pay at a batch size (they cost ~0.2 ms)


@dataclass(frozen=True)
class Estimator:
    """Acceptance at a block position from decayed counts of outcomes: (strength * live prior + hits) / (strength +
    trials), the counts starting at `start` outcomes at the prior and each earlier outcome weighing `decay` times the
    next one."""

    decay: float
    start: float
    strength: float = 0.0

    def counts(self, prior: list[float]) -> tuple[list[float], list[float]]:
        """(hits, trials) per position to start from."""
        return [self.start * p for p in prior], [self.start] * len(prior)

    def learn(self, hits: list[float], trials: list[float], k: int, hit: float, prior: float = 0.0) -> float:
        """Counts one outcome at position k; the new estimate there."""
        hits[k], trials[k] = self.decay * hits[k] + hit, self.decay * trials[k] + 1
        return (self.strength * prior + hits[k]) / (self.strength + trials[k])


# A request's lookup estimates follow its recent outcomes alone (a moving average, 0.3 for the newest: copying comes in
# bursts); its DFlash estimates stay near the shared prior (its ~20 latest outcomes weigh as 64 at the prior: per
# step they are noisy, and per request they told little in a replay of 80 prompts). The shared priors: lookup a moving
# average (0.05 for the newest: every proposal is scored, verified or not); DFlash from counts over its last ~300
# verified outcomes, starting as 16 outcomes at the initial prior, so a useless drafter is given up within a few
# dozen outcomes but a few misses in a row do not stop the drafting that would correct them.
REQUEST_ESTIMATORS = {LOOKUP: Estimator(0.7, 1 / 0.3), DFLASH: Estimator(0.95, 0.0, 64.0)}
PRIOR_ESTIMATORS = {LOOKUP: Estimator(0.95, 20.0), DFLASH: Estimator(0.997, 16.0)}
LOOKUP_PRIOR = {2: 0.55, 3: 0.65}  # initial acceptance of a lookup proposal by match length (0.8 beyond):
# measured on held-out greedy responses (data/responses), n = 2: 0.56 0.69 0.78, n = 4: 0.95 0.95 0.98


@dataclass
class SpecOptions:
    block_size: int  # the largest block (the drafter's, or the server's limit)
    adaptive: bool = True
    lookup: bool = True
    lookup_min_n: int = 2
    lookup_max_n: int = 4


@dataclass
class ReqSpecState:
    """A request's proposer state: its n-gram index and acceptance estimates per estimate key (`Plan.key`)
    and position."""

    index: NgramIndex
    accept: dict[str, list[float]]  # per estimate key and position (`REQUEST_ESTIMATORS`)
    hits: dict[str, list[float]]  # the decayed counts behind them
    trials: dict[str, list[float]]
    since_dflash: int = EXPLORE_JOIN  # steps since DFlash was last verified for this request
    shadow: tuple[int, list[int], int] | None = None  # a lookup proposal not verified: (its position, tokens, n)
    drafts: bool = True  # its draft context K/V is complete: DFlash may draft for it


@dataclass
class Plan:
    """One request's part of a step: the source and the number of tokens verified (bonus included)."""

    source: str
    block_len: int
    lookup_tokens: list[int] = field(default_factory=list)
    match_n: int = 0  # a lookup proposal's suffix-match length

    @property
    def key(self) -> str:
        """The acceptance estimate this plan's outcome updates."""
        return lookup_key(self.match_n) if self.source == LOOKUP else self.source


def lookup_key(n: int) -> str:
    return f"{LOOKUP}{n}"


def step_shape(plans: list[Plan]) -> tuple[int, int, int]:
    """(verify tokens, draft tokens, requests) of a step of these plans, as the cost model takes them: the draft
    forward runs over the DFlash rows, each padded to their longest block."""
    widths = [p.block_len for p in plans if p.source == DFLASH]
    return sum(p.block_len for p in plans), len(widths) * max(widths, default=0), len(plans)


class SpecPolicy:
    def __init__(self, options: SpecOptions, cost: CostModel | None):
        self.options = options
        self.cost = cost
        width = options.block_size - 1
        self.prior = {DFLASH: [0.5] * width}
        for n in range(options.lookup_min_n, options.lookup_max_n + 1):
            self.prior[lookup_key(n)] = [LOOKUP_PRIOR.get(n, 0.8)] * width
        # per lookup key, (expected, accepted) drafts of the proposals verified, decaying: the policy takes the
        # proposals whose estimates are high, so what they realise falls short of what was expected (measured
        # at 32 requests: 2-gram lookups 0.62 expected, 0.47 accepted); the gains are scaled by the ratio. Not
        # DFlash: its request estimates are held near the prior, and scaling them too kept it from paying blocks
        self.prior_counts = {key: estimator(PRIOR_ESTIMATORS, key).counts(p) for key, p in self.prior.items()}
        self.realised = {key: [REALISED_PRIOR, REALISED_PRIOR] for key in self.prior if key != DFLASH}
        self.explore_credit = 0.0  # predicted seconds exploring may still spend (EXPLORE_BUDGET of each step's)
        self.since_plain = 0  # steps since the last one of plain rows only
        self.plain_plans = 0  # plans in a row of plain rows only ...
        self.skip = 0  # ... and the unplanned plain steps still due after them
        self.unplanned = 0  # unplanned steps since the last plan (they earn exploring credit too)
        self.materialise = True  # whether the draft's context K/V of committed tokens is worth writing ...
        self.cannot_pay = 0  # ... (off after MATERIALISE_OFF_AFTER plans in a row in which DFlash could not pay)
        self.pays: dict[tuple[int, int], bool] = {}  # (requests, width) -> whether DFlash could pay, lately
        self.plans = 0  # plans made

    def new_state(self) -> ReqSpecState:
        """A new request's state: its estimates start from the prior."""
        o = self.options
        counts = {key: estimator(REQUEST_ESTIMATORS, key).counts(p) for key, p in self.prior.items()}
        return ReqSpecState(NgramIndex(o.lookup_min_n, o.lookup_max_n), {s: list(p) for s, p in self.prior.items()},
                            {key: c[0] for key, c in counts.items()}, {key: c[1] for key, c in counts.items()})

    def plan(
        self, states: list[ReqSpecState], histories: list[tuple[list[int], list[int]]] | None, limits: list[int]
    ) -> list[Plan]:
        """Plans one step. histories: each request's (prompt, outputs) with the bonus last, when the host has
        them up to date (lookup needs them), else None; limits: each request's largest block."""
        if self.skip:  # set by adaptive plans only
            self.skip -= 1
            self.unplanned += 1
            self.since_plain = 0
            return [Plan(NONE, 1) for _ in states]
        lookups = [([], 0)] * len(states)
        if self.options.lookup and histories is not None:
            for st, (prompt, output) in zip(states, histories):
                st.index.sync(prompt, output)
                self._score_shadow(st)
            lookups = [st.index.propose(lim - 1) for st, lim in zip(states, limits)]
        if not self.options.adaptive:
            return [
                Plan(LOOKUP, 1 + len(t), t, n) if t else Plan(DFLASH, lim) if lim > 1 else Plan(NONE, 1)
                for (t, n), lim in zip(lookups, limits)
            ]
        bs = len(states)
        self.plans += 1
        self._decide_materialise(bs, max(limits))
        keys = [lookup_key(n) if t else None for t, n in lookups]
        look = self.gain_matrix(states, keys, [len(t) for t, _ in lookups])
        no_draft = with_draft = self._best(lookups, look, None)
        if any(st.drafts for st in states):
            draft = self.gain_matrix(states, [DFLASH] * bs, [lim - 1 if st.drafts else 0
                                                             for st, lim in zip(states, limits)])
            with_draft = self._best(lookups, look, draft)
        rate, seconds, plans = max(no_draft, with_draft, key=lambda x: x[0])
        self.since_plain = 0 if all(p.source == NONE for p in plans) else self.since_plain + 1
        if self.since_plain >= CHECK_EVERY and rate < CHECK_GAIN * bs / self.cost.step_time(bs, 0, bs):
            self.since_plain = 0
            plans = [Plan(NONE, 1) for _ in states]
        else:
            plans = self._explore(states, limits, plans, seconds)
            self.plain_plans = self.plain_plans + 1 if all(p.source == NONE for p in plans) else 0
            self.skip = min(self.plain_plans, PLAIN_SKIP)
        for st, plan, (toks, n) in zip(states, plans, lookups):
            if toks and plan.source != LOOKUP and st.shadow is None:
                st.shadow = (len(st.index.tokens), toks, n)
        return plans

    def _decide_materialise(self, bs: int, limit: int) -> None:
        """`materialise` for a batch of bs requests: on while DFlash blocks could pay at this size
        (`_dflash_could_pay`, re-evaluated every PAYS_EVERY plans), off after MATERIALISE_OFF_AFTER plans in a row
        in which they could not."""
        width = min(limit, self.options.block_size)
        if self.plans % PAYS_EVERY == 0:
            self.pays.clear()
        if (bs, width) not in self.pays:
            self.pays[bs, width] = width > 1 and self._dflash_could_pay(bs, width)
        if self.pays[bs, width]:
            self.cannot_pay, self.materialise = 0, True
            return
        self.cannot_pay += 1
        self.materialise = self.cannot_pay < MATERIALISE_OFF_AFTER

    def _dflash_could_pay(self, bs: int, width: int) -> bool:
        """Whether DFlash blocks of some width (the same for every request, up to `width`) would beat plain rows for
        bs requests, crediting each block position with the shared prior's acceptance or MATERIALISE_FLOOR, whichever
        is higher."""
        est = np.maximum(np.array(self.prior[DFLASH][: width - 1]), MATERIALISE_FLOOR)
        widths = np.arange(2, width + 1)
        rates = bs * (1 + np.cumsum(np.cumprod(est))) / self.cost.step_times(bs * widths, bs * widths, bs)
        return bool(rates.max() > bs / self.cost.step_time(bs, 0, bs))

    def _score_shadow(self, st: ReqSpecState) -> None:
        """Learns from a lookup proposal the plan did not verify, once the tokens it predicted are committed: the
        estimates follow every proposal, not only those taken (else a source that failed where it was tried is never
        tried again). Unbiased when sampling too: a committed token equals a point-mass proposal with the probability
        verification would have accepted it."""
        if st.shadow is None:
            return
        start, toks, n = st.shadow
        if start > len(st.index.tokens):  # the history was rebuilt shorter
            st.shadow = None
            return
        actual = st.index.tokens[start : start + len(toks)]
        matched = next((i for i, (x, y) in enumerate(zip(toks, actual)) if x != y), len(actual))
        if matched == len(actual) < len(toks):  # every token so far matches: wait for the rest
            return
        st.shadow = None
        self._learn(st, lookup_key(n), len(toks), matched)

    def gain_matrix(self, states: list[ReqSpecState], keys: list[str | None], lens: list[int]) -> np.ndarray:
        """[requests, block_size - 1]: expected extra committed tokens of each request's first lens[i] drafts from
        the source whose estimates are keys[i] (None: no proposal), 0 beyond: cumulative products of the request's
        estimates, a lookup's scaled by what its proposals realised against their expectation. Only the rows with a
        proposal are computed (at 32 requests a few have a lookup match)."""
        width = self.options.block_size - 1
        gains = np.zeros((len(states), width))
        rows = [i for i, (k, n) in enumerate(zip(keys, lens)) if k and n]
        if not rows:
            return gains
        est = np.array([states[i].accept[keys[i]] for i in rows], np.float64).reshape(-1, width)
        ratio = np.array([self.realised[k][1] / self.realised[k][0] if k in self.realised else 1.0
                          for k in (keys[i] for i in rows)])
        g = np.cumprod(est, axis=1) * ratio[:, None]
        g[np.arange(width) >= np.array([lens[i] for i in rows])[:, None]] = 0.0
        gains[rows] = g
        return gains

    def gains(self, state: ReqSpecState, key: str, n: int) -> list[float]:
        """One request's row of `gain_matrix`: its first n drafts from `key`."""
        return self.gain_matrix([state], [key], [n])[0, :n].tolist()

    def _explore(self, states: list[ReqSpecState], limits: list[int], plans: list[Plan], step: float) -> list[Plan]:
        """Keeps learning what DFlash would give the requests that stopped using it, in shared draft forwards;
        the less DFlash's first draft is accepted across requests (the shared prior), the rarer."""
        slow = min(EXPLORE_SLOWEST, max(1.0, EXPLORE_PRIOR / max(self.prior[DFLASH][0], 1e-9)))
        due = [i for i, (st, lim) in enumerate(zip(states, limits))
               if st.since_dflash >= EXPLORE_JOIN * slow and plans[i].source == NONE and lim > 1 and st.drafts]
        drafting = any(p.source == DFLASH for p in plans)  # step: the plans' predicted time
        # the credit saved up is capped (at ~5 steps at most)
        self.explore_credit = min(self.explore_credit + EXPLORE_BUDGET * step * (1 + self.unplanned),
                                  EXPLORE_BUDGET * EXPLORE_EVERY * EXPLORE_SLOWEST * step)
        self.unplanned = 0
        if not due or not (drafting or any(states[i].since_dflash >= EXPLORE_EVERY * slow for i in due)):
            return plans
        explored = list(plans)
        for i in due:
            explored[i] = Plan(DFLASH, min(limits[i], EXPLORE_BLOCK))
        extra = self._step_time(explored) - step
        if extra > self.explore_credit:  # exploring now would spend more than its share of the time
            return plans
        self.explore_credit -= extra
        return explored

    def _step_time(self, plans: list[Plan]) -> float:
        """The cost model's time of a step of these plans."""
        return self.cost.step_time(*step_shape(plans))

    def _best(self, lookups: list[tuple[list[int], int]], look: np.ndarray, draft: np.ndarray | None
              ) -> tuple[float, float, list[Plan]]:
        """The best plan of a batch without (draft None) or with a draft forward: (expected tokens per second,
        predicted seconds, plans), from the `gain_matrix` of the lookup proposals and of DFlash. Each row takes the
        source whose proposal promises more, then the extensions of all rows are taken in order of expected gain (a
        row's gains never rise, so its blocks grow one token at a time) while they raise the expected tokens per
        second."""
        bs, width = look.shape
        use_draft = np.zeros(bs, bool) if draft is None else draft.sum(1) > look.sum(1)
        gains = look if draft is None else np.where(use_draft[:, None], draft, look)
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")[: np.count_nonzero(flat > 0)]  # ties: a row's k-th extension first
        row, pos = np.divmod(order, max(width, 1))
        # the draft forward runs over the DFlash rows, at their longest block
        is_draft = use_draft[row]
        draft_rows = np.cumsum(is_draft & (pos == 0))
        draft_width = np.maximum.accumulate(np.where(is_draft, pos + 2, 0)) if len(row) else row
        drafted = np.concatenate([[0], draft_rows * draft_width])
        expected = bs + np.concatenate([[0.0], np.cumsum(flat[order])])  # one bonus per request + drafts taken
        seconds = self.cost.step_times(bs + np.arange(len(row) + 1), drafted, bs)
        rates = expected / seconds
        taken = int(np.argmax(rates))
        lens = 1 + np.bincount(row[:taken], minlength=bs)
        plans = []
        for n, drafts, (toks, match_n) in zip(lens.tolist(), use_draft.tolist(), lookups):
            if n == 1:
                plans.append(Plan(NONE, 1))
            else:
                plans.append(Plan(DFLASH, n) if drafts else Plan(LOOKUP, n, toks[: n - 1], match_n))
        return float(rates[taken]), float(seconds[taken]), plans

    def observe(self, states: list[ReqSpecState], plans: list[Plan], accepted: list[int]) -> None:
        """Updates the estimates from a verified step: request i accepted `accepted[i]` of its drafts."""
        for realised in self.realised.values():
            realised[0] = REALISED_RELAX * realised[0] + (1 - REALISED_RELAX) * REALISED_PRIOR
            realised[1] = REALISED_RELAX * realised[1] + (1 - REALISED_RELAX) * REALISED_PRIOR
        for st, plan, a in zip(states, plans, accepted):
            st.since_dflash = 0 if plan.source == DFLASH else st.since_dflash + 1
            if plan.source == NONE:
                continue
            if (realised := self.realised.get(plan.key)) is not None:
                expected = sum(_prefix_gains(st.accept[plan.key], plan.block_len - 1))
                realised[0] = REALISED_DECAY * realised[0] + expected
                realised[1] = REALISED_DECAY * realised[1] + a
            self._learn(st, plan.key, plan.block_len - 1, a)

    def _learn(self, st: ReqSpecState, key: str, drafts: int, accepted: int) -> None:
        """The request's and the shared estimates of `key` after `accepted` of `drafts` proposed tokens."""
        est, prior = st.accept[key], self.prior[key]
        own, shared = estimator(REQUEST_ESTIMATORS, key), estimator(PRIOR_ESTIMATORS, key)
        for k in range(min(accepted + 1, drafts, len(est))):  # position k was verified
            hit = 1.0 if k < accepted else 0.0
            prior[k] = shared.learn(*self.prior_counts[key], k, hit)
            est[k] = own.learn(st.hits[key], st.trials[key], k, hit, prior[k])


def estimator(estimators: dict[str, Estimator], key: str) -> Estimator:
    """The estimator of `key` (a lookup key: LOOKUP's)."""
    return estimators[LOOKUP if key.startswith(LOOKUP) else key]


def _prefix_gains(accept: list[float], n: int) -> list[float]:
    """Expected extra committed tokens of each of the first n drafts: cumulative products of acceptance."""
    out, p = [], 1.0
    for q in accept[:n]:
        p *= q
        out.append(p)
    return out
