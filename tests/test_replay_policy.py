"""The policy replay (scripts/replay_policy.py): its bookkeeping on hand-computed cases, and the policy's choices it
is meant to show (a right drafter is taken, a useless one dropped, a repeating text goes to lookup)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from replay_policy import replay  # noqa: E402

from sglang_dflash.speculative.cost_model import CostModel  # noqa: E402

COST = CostModel({1: 14.4, 2: 14.8, 4: 14.9, 8: 16.2, 16: 23.5, 32: 34.0}, {16: 3.66, 64: 8.0})  # this CPU's, ms


def seq(response: list[int], runs: list[int]) -> dict:
    return {"dataset": "x", "prompt": [1, 2, 3], "response": response, "runs": runs}


def test_fixed_blocks_commit_what_the_runs_say():
    """Drafts right 3 at a time: 64 tokens after the prefill's in 16 blocks of 4, each priced by the cost model."""
    r = replay([seq(list(range(100, 165)), [3] * 64)], COST, "fixed4", 16)
    assert r["tau"] == 4.0 and r["steps"]["dflash"] == 1.0
    assert r["ratio"] == pytest.approx(64 * COST.step_time(1, 0, 1) / (16 * COST.step_time(4, 4, 1)))


def test_a_right_drafter_is_taken_and_a_useless_one_dropped():
    seqs = [seq(list(range(100 + i, 300 + i)), [15] * 199) for i in range(4)]
    right = replay(seqs, COST, "adaptive", 16)
    assert right["tau"] > 6 and right["ratio"] > 3
    never = replay(seqs, COST, "never", 16)
    assert never["steps"]["none"] > 0.9 and never["ratio"] > 0.97


def test_a_repeating_text_goes_to_lookup():
    """No proposal of the drafter is right; the response repeats a 20-token phrase."""
    phrase = list(range(500, 520))
    r = replay([seq(phrase * 10, [0] * 199)], COST, "default", 16)
    assert r["steps"]["lookup"] > 0.3 and r["tau"] > 3 and r["ratio"] > 2
