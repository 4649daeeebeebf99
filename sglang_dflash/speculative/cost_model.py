"""CostModel: the time of a speculative step as a function of its requests, verify tokens and draft tokens.

From timed forwards of the real target and drafter on the actual device at start-up (`calibrate`: one
request, short context; piecewise-linear in the tokens), then corrected online from measured steps by least
squares that forget old steps:

    seconds ~ a * verify(R) + b * (verify(T) - verify(R)) + e * (T - R) + g * tiles(R, T) + c * draft(D) + f * R

R the requests, T the verify tokens, D the draft tokens. `a` scales the calibrated forward of R tokens to what a
real batch of R requests costs (attention over long contexts, host work); `b` the calibrated cost of the
speculative verify tokens (the GEMMs: on a CPU their cost steps up where the token count crosses a tile
boundary, e.g. 32 -> 33, which the calibration sees); `e` what each such token adds beyond it in a real batch
(attention over its request's context: ~0.5-1.5 ms on a 2-core CPU at 300-700 positions); `g` what each
TILE_ROWS-row tile the speculative tokens start adds in a real batch beyond the calibration's step (measured at 32
requests and 400 positions: 33 rows +9% over 32, the next rows ~1 ms each; the calibration's own 32 -> 33 step is
a few ms); `c` the draft forward's share; `f` what each request adds beyond the calibration's 1-token rows (attention
over its context, its host work: at 16 requests and ~400 positions a real step took ~29 ms against the calibration's
17 ms). Priors a = b = c = 1, e = g = f = 0.

A step of R requests is predicted by a fit of the steps of about R requests (`coef_at`: each observed batch size
weighs exp(-2 log2(R' / R)^2), ~0.14 an octave away, nothing two octaves away) with the prior: a CPU batch of 16
is compute-bound where a batch of 1 streams weights, so what a speculative token or the draft forward costs at 16
requests says little about 1 (fitted across all sizes, a lone request left at the end of a wave of 16 was predicted
at 33-37 ms for a 16-token DFlash block the calibration timed at 20 ms, and the last requests stopped speculating).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# A CPU GEMM's time steps up one row past a multiple of its row tile (oneDNN bf16: 16, measured on a 2-core AMX
# CPU, a whole decode forward: 32 -> 33 rows +5.5 ms, 48 -> 49 +13 ms, ~0.7 ms a row in between; our AVX512-BF16
# kernel: one more pass over each weight block per 8 rows, 8 -> 9 rows +2.3 ms over one forward's layers): points on
# both sides of each step, so the first speculative token of a batch is priced at the step it costs
CALIBRATION_TOKENS = (1, 2, 4, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 64, 65, 96, 97, 128, 129, 256, 512)
FORGET = 0.99  # weight of the past in the online fit, per observed step
PRIOR_WEIGHT = 0.2  # the prior (a = b = c = 1, e = g = 0) counts as this many steps
TYPICAL_SPEC_TOKENS = 16  # speculative verify tokens of the prior's steps
PROBE_TOKENS = (1, 16)  # verify sizes timed at start-up to check a cached calibration ...
STALE = 1.3  # ... which is redone when off by more than this factor
MAX_UNFITTED = 256  # observed steps folded into the fit's sums at the latest after this many
REFIT_STEPS = 16  # predictions use the fit of at most this many steps ago (a refit costs ~0.2 ms: every plan's
# refit was a third of the planning time at 16 requests)
TILE_ROWS = 16  # the row tile of a CPU GEMM (oneDNN); where the tiles do not step the cost, g stays 0
LOWER_BOUNDS = np.array([0.2, 0.2, 0.0, 0.0, 0.0, 0.0])  # a, c, b, e, g, f: more tokens never cost less
PRIOR_COEF = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # a, c, b, e, g, f: the calibration as timed


class Curve:
    """Seconds of a forward over n tokens: piecewise-linear through timed points (flat below the first: a forward
    has a fixed cost; extended linearly past the last), tabulated at whole token counts so that the policy's
    hundreds of candidate steps a step cost one array lookup. No tokens, no forward: 0 s."""

    def __init__(self, points: dict[int, float]):
        self.points = _monotone(points)
        self.table = self._tabulate(1024)

    def _tabulate(self, size: int) -> np.ndarray:
        table = _interp(self.points, np.arange(size, dtype=np.float64))
        table[0] = 0.0
        return table

    def __call__(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and int(tokens.max()) >= len(self.table):
            self.table = self._tabulate(2 * int(tokens.max()))
        return self.table[tokens]


class CostModel:
    def __init__(self, verify: dict[int, float], draft: dict[int, float]):
        self.verify = Curve(verify)
        self.draft = Curve(draft)
        # the prior weighs as PRIOR_WEIGHT steps of typical features, and never fades
        spec = self.calibrated(1 + TYPICAL_SPEC_TOKENS, 0) - self.calibrated(1, 0)
        typical = np.array([self.verify.points[0][1], self.draft.points[0][1], spec, float(TYPICAL_SPEC_TOKENS), 1.0,
                            1.0])
        self.prior_xx = np.diag(PRIOR_WEIGHT * typical**2)
        self.prior_xy = self.prior_xx @ PRIOR_COEF
        self.unfitted: list[tuple[int, int, int, float]] = []  # steps observed since the last fold
        # least-squares sums per batch size (indexed by it; `seen`: sizes observed), grown to the largest seen
        self.sums_xx, self.sums_xy, self.seen = np.zeros((1, 6, 6)), np.zeros((1, 6)), np.zeros(1, bool)
        self.local: dict[int, tuple[np.ndarray, tuple[bool, ...]]] = {}  # coef_at's fits since the last fold

    def _fold(self) -> None:
        """Adds the unfitted steps to the least-squares sums of their batch sizes, each weighing FORGET less per later
        step (array operations over every batch size at once: a fold costs the same whatever sizes were seen)."""
        verify, draft, requests, seconds = (np.array(c) for c in zip(*self.unfitted))
        self.unfitted = []
        x = self.features(verify, draft, requests)
        w = FORGET ** np.arange(len(seconds) - 1, -1, -1, dtype=np.float64)
        grow = int(requests.max()) + 1 - len(self.seen)
        if grow > 0:
            self.sums_xx = np.concatenate([self.sums_xx, np.zeros((grow, 6, 6))])
            self.sums_xy = np.concatenate([self.sums_xy, np.zeros((grow, 6))])
            self.seen = np.concatenate([self.seen, np.zeros(grow, bool)])
        decay = FORGET ** len(seconds)
        self.sums_xx *= decay
        self.sums_xy *= decay
        np.add.at(self.sums_xx, requests, w[:, None, None] * x[:, :, None] * x[:, None, :])
        np.add.at(self.sums_xy, requests, (w * seconds)[:, None] * x)
        self.seen[requests] = True
        self.local = {r: (np.zeros(0), held) for r, (_, held) in self.local.items()}  # refit when next asked

    def coef_at(self, requests: int) -> np.ndarray:
        """(a, c, b, e, g, f) for steps of `requests` requests: the fit within LOWER_BOUNDS of the observed steps
        weighted by how near their batch size is (see the module docstring), with the prior; refit when read after a
        fold (the coefficients held at their bounds last time are tried first)."""
        if self.unfitted:
            self._fold()
        coef, held = self.local.get(requests, (np.zeros(0), (False,) * 6))
        if coef.size:
            return coef
        sizes = np.flatnonzero(self.seen)
        weight = np.exp(-2.0 * np.log2(sizes / requests) ** 2)
        sizes, weight = sizes[weight > 1e-6], weight[weight > 1e-6]
        near = sizes.size > 0
        xx = self.prior_xx + np.tensordot(weight, self.sums_xx[sizes], 1)
        xy = self.prior_xy + weight @ self.sums_xy[sizes]
        # no step of a near size: the prior's coefficients (its sums alone can be singular: a flat calibration)
        coef, held = _bounded_solve(xx, xy, LOWER_BOUNDS, held) if near else (PRIOR_COEF, held)
        self.local[requests] = (coef, held)
        return coef

    def features(self, verify_tokens, draft_tokens, requests) -> np.ndarray:
        """[..., 6]: calibrated verify time of one token per request, calibrated draft time (0 without a draft
        forward), calibrated verify time of the speculative tokens (those beyond one per request), their count,
        the GEMM row tiles they start, the requests."""
        verify_tokens, requests = np.asarray(verify_tokens, np.int64), np.asarray(requests, np.int64)
        base = self.verify(requests)
        tiles = (-requests // TILE_ROWS) - (-verify_tokens // TILE_ROWS)  # ceil(T / tile) - ceil(R / tile)
        return np.stack(np.broadcast_arrays(
            base, self.draft(draft_tokens), self.verify(verify_tokens) - base, verify_tokens - requests, tiles,
            requests,
        ), axis=-1).astype(np.float64)

    def calibrated(self, verify_tokens: int, draft_tokens: int) -> float:
        """The calibration's time of one request verifying `verify_tokens` (+ a draft forward)."""
        return float(self.verify(verify_tokens) + self.draft(draft_tokens))

    def step_time(self, verify_tokens: int, draft_tokens: int, requests: int) -> float:
        """Predicted seconds of a step of `requests` requests verifying `verify_tokens` in all with a draft
        forward over `draft_tokens` (0: no draft forward)."""
        return float(self.step_times(verify_tokens, draft_tokens, requests))

    def step_times(self, verify_tokens, draft_tokens, requests: int) -> np.ndarray:
        """step_time of many candidate steps of `requests` requests at once (arrays of token counts), by the fit of
        at most REFIT_STEPS observed steps ago."""
        requests = int(requests)
        cached = self.local.get(requests, (np.zeros(0),))[0]
        coef = cached if cached.size and len(self.unfitted) < REFIT_STEPS else self.coef_at(requests)
        return self.features(verify_tokens, draft_tokens, requests) @ coef

    def observe(self, verify_tokens: int, draft_tokens: int, requests: int, seconds: float) -> None:
        """One measured step (the fits follow when next read, see `step_times`)."""
        if seconds > 0:
            self.unfitted.append((verify_tokens, draft_tokens, requests, seconds))
        if len(self.unfitted) >= MAX_UNFITTED:
            self._fold()

    def agrees(self, verify_times: dict[int, float]) -> bool:
        """Whether measured verify times (tokens -> seconds) match this calibration within a factor STALE."""
        return all(1 / STALE <= self.calibrated(n, 0) / t <= STALE for n, t in verify_times.items())

    def to_dict(self) -> dict:
        return {"verify": dict(self.verify.points), "draft": dict(self.draft.points)}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls({int(k): v for k, v in d["verify"].items()}, {int(k): v for k, v in d["draft"].items()})


def _bounded_solve(xx: np.ndarray, xy: np.ndarray, lower: np.ndarray, held: tuple[bool, ...]) -> tuple[
        np.ndarray, tuple[bool, ...]]:
    """argmin of c'(xx)c - 2c'(xy) subject to c >= lower, and which coefficients sit at their bounds: the fit that
    holds `held` (the last step's answer) at their bounds if it is optimal (the problem is convex: optimal where
    the free coefficients are within bounds and raising a held one would not lower the loss), else the best over
    every subset held. (Clipping the free solution is not the bounded optimum: with b and e nearly collinear, a
    clipped e leaves b at its share of a joint fit.)"""

    def fit(subset: tuple[bool, ...]) -> np.ndarray:
        fixed = np.array(subset)
        free = ~fixed
        coef = lower.copy()
        if free.any():
            rhs = xy[free] - xx[np.ix_(free, fixed)] @ lower[fixed]
            coef[free] = np.linalg.solve(xx[np.ix_(free, free)], rhs)
        return coef

    coef = fit(held)
    fixed = np.array(held)
    if (coef[~fixed] >= lower[~fixed]).all() and (xx @ coef - xy)[fixed].min(initial=0.0) >= 0:
        return coef, held
    best, best_loss = (lower.copy(), held), float("inf")
    for subset in itertools.product((False, True), repeat=len(xy)):
        coef = fit(subset)
        loss = coef @ xx @ coef - 2 * coef @ xy
        if (coef >= lower).all() and loss < best_loss:
            best, best_loss = (coef, subset), loss
    return best


def _monotone(points: dict[int, float]) -> list[tuple[int, float]]:
    """Sorted points made non-decreasing from above: a forward over fewer tokens costs at most what one over
    more tokens was measured at (timing noise only ever adds time, so the lower value is the truer one)."""
    out, low = [], float("inf")
    for n, t in sorted(points.items(), reverse=True):
        low = min(low, t)
        out.append((n, low))
    return out[::-1]


def _interp(points: list[tuple[int, float]], x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through the points: flat below the first (a forward has a fixed cost), extended
    linearly past the last."""
    xs, ys = np.array(points, dtype=np.float64).T
    out = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), out)
    return out


def calibrate(
    verify: Callable[[int], object], draft: Callable[[int], object], sync: Callable[[], None], max_tokens: int,
    draft_block: int, rounds: int = 5,
) -> CostModel:
    """Times verify(n) (a target forward over n new tokens) and draft(n) (a draft forward over n tokens,
    n a multiple of draft_block) for n up to max_tokens."""
    sizes = [n for n in CALIBRATION_TOKENS if n <= max_tokens] or [1]
    draft_sizes = sorted({max(draft_block, n // draft_block * draft_block) for n in sizes})
    calls = [(verify, n, "verify") for n in sizes] + [(draft, n, "draft") for n in draft_sizes]
    best = time_calls(calls, sync, rounds)
    return CostModel({n: best["verify", n] for n in sizes}, {n: best["draft", n] for n in draft_sizes})


def probe(verify: Callable[[int], object], sync: Callable[[], None], max_tokens: int) -> dict[int, float]:
    """A quick check of a cached calibration: the verify times of a few sizes (fastest of 2 rounds)."""
    calls = [(verify, n, "verify") for n in PROBE_TOKENS if n <= max_tokens] or [(verify, 1, "verify")]
    return {n: t for (_, n), t in time_calls(calls, sync, rounds=2).items()}


def time_calls(calls: list[tuple[Callable[[int], object], int, str]], sync: Callable[[], None],
               rounds: int) -> dict[tuple[str, int], float]:
    """Every call once per round, after one warm-up round, so a burst of other load spreads over the sizes;
    each (kind, n) keeps its fastest time."""
    best = {(kind, n): float("inf") for _, n, kind in calls}
    for r in range(rounds + 1):
        for fn, n, kind in calls:
            sync()
            start = time.perf_counter()
            fn(n)
            sync()
            if r > 0:  # round 0 warms up
                best[kind, n] = min(best[kind, n], time.perf_counter() - start)
    return best


def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_DFLASH_CACHE", Path.home() / ".cache" / "sglang_dflash")) / "cost_models"


def load_or_calibrate(key: dict, run: Callable[[], CostModel],
                      check: Callable[[], dict[int, float]] | None = None) -> CostModel:
    """The cost model calibrated earlier for this key (device, model, drafter, dtype, threads), else run().
    With `check` (a quick probe of verify times), a cached model is kept only while the probe agrees with it
    within a factor STALE: machines that share a key (virtual machines on other hosts) are not as fast."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{digest}.json"
    if path.is_file():
        try:
            cached = CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError):
            cached = None  # a corrupt cache entry is recalibrated
        if cached is not None and (check is None or cached.agrees(check())):
            return cached
    model = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**model.to_dict(), "key": key}))
    tmp.replace(path)
    return model
