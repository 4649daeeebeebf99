"""Drafter diagnostics (scripts/eval_drafter.py): the teacher-forced runs of a drafter equal the runs of its
real proposals (DFlash 1 and 2, with a draft vocabulary), the baselines equal naive reference scans, the
acceptance summary, and the script end to end on the default target."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from dflash_helpers import tiny_target_config

from sglang_dflash.models.dflash import random_draft_model
from sglang_dflash.models.dflash2 import DFlash2Config, random_dflash2_model
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.training.baselines import TrigramModel, lookup_runs
from sglang_dflash.training.block_attention import draft_blocks_forward
from sglang_dflash.training.evaluate import acceptance_summary, drafter_runs

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN, BLOCK, MASK = 48, 32, 5, 5


def tiny_drafter(dflash2: bool, seed: int):
    cfg = DFlashConfig.for_target(tiny_target_config(VOCAB, layers=8), 2, BLOCK, MASK)
    cfg.target_layer_ids = [1, 5]
    cfg.draft_vocab = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:36].tolist())
    if dflash2:
        model = random_dflash2_model(DFlash2Config.extend(cfg, 3, 8, 4, 4), seed=seed, std=0.3)
    else:
        model = random_draft_model(cfg, seed=seed, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    model.bind_target(torch.nn.Embedding.from_pretrained(torch.randn(VOCAB, HIDDEN, generator=g)),
                      torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    model.prepare_inference(torch.device("cpu"))
    return model.eval()


def proposal(draft, features: torch.Tensor, ids: list[int], anchor: int) -> list[int]:
    """What the draft proposes (its `propose`, the inference rule) from the block at `anchor`."""
    t = torch.tensor(ids)
    h = draft_blocks_forward(draft, features, t, torch.tensor([anchor]), BLOCK)
    return draft.propose(h.view(1, BLOCK, -1)[:, 1:], t[anchor : anchor + 1])[0][0].tolist()


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@torch.no_grad()
def test_teacher_forced_runs_equal_the_runs_of_real_proposals(dflash2: bool):
    """A sequence that mostly follows the draft's own proposals (its first one or two tokens, so runs of 1 and 2
    occur by construction), then at every anchor: the accepted run of `propose`'s drafts == drafter_runs'
    teacher-forced run."""
    draft = tiny_drafter(dflash2, seed=3)
    g = torch.Generator().manual_seed(4)
    length, prompt_len = 40, 7
    features = torch.randn(length, 2 * HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist()
    while len(ids) < length:
        drafts, u = proposal(draft, features, ids, len(ids) - 1), float(torch.rand(1, generator=g))
        ids += drafts[:2] if u < 0.4 else drafts[:1] if u < 0.8 else [int(torch.randint(0, VOCAB, (1,), generator=g))]
    ids = ids[:length]
    expect = []
    for a in range(prompt_len, length - 1):
        run = 0
        for tok, gold in zip(proposal(draft, features, ids, a), ids[a + 1 :]):
            if tok != gold:
                break
            run += 1
        expect.append(run)
    got = drafter_runs(draft, features, ids, prompt_len).tolist()
    assert got == expect
    assert drafter_runs(draft, features, ids, prompt_len, stride=3).tolist() == expect[::3]
    assert sum(r > 0 for r in got) >= len(got) // 3 and max(got) >= 2  # not trivially all zero


def test_trigram_predicts_a_most_frequent_continuation():
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 6, (30,), generator=g).tolist() for _ in range(8)]
    model = TrigramModel(seqs)
    tri: dict[tuple[int, int], Counter] = {}
    for s in seqs:
        for a, b, c in zip(s, s[1:], s[2:]):
            tri.setdefault((a, b), Counter())[c] += 1
    for key, counts in tri.items():
        assert counts[model.next(*key)] == max(counts.values())
    ids = seqs[0]
    for a, run in zip(range(4, len(ids) - 1), model.runs(ids, 4, BLOCK).tolist()):
        drafts = [model.next(ids[t - 2], ids[t - 1]) for t in range(a + 1, min(a + BLOCK, len(ids)))]
        naive = next((i for i, (d, x) in enumerate(zip(drafts, ids[a + 1 :])) if d != x), len(drafts))
        assert run == naive


def test_lookup_runs_match_a_naive_scan():
    g = torch.Generator().manual_seed(6)
    pattern = torch.randint(0, 9, (7,), generator=g).tolist()
    ids = (pattern * 3 + torch.randint(0, 9, (10,), generator=g).tolist()) * 2
    prompt_len, min_n, max_n = 5, 2, 4
    runs, matches = lookup_runs(ids, prompt_len, BLOCK, min_n, max_n)
    for i, a in enumerate(range(prompt_len, len(ids) - 1)):
        hist = ids[: a + 1]
        proposal, n_found = [], 0
        for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
            ends = [e for e in range(n - 1, len(hist) - 1) if hist[e - n + 1 : e + 1] == hist[-n:]]
            if ends:
                proposal, n_found = hist[ends[-1] + 1 : ends[-1] + BLOCK], n
                break
        naive = next((k for k, (d, x) in enumerate(zip(proposal, ids[a + 1 :])) if d != x),
                     min(len(proposal), len(ids) - a - 1))
        assert (int(runs[i]), int(matches[i])) == (naive, n_found), a
    assert int((runs > 0).sum()) > len(runs) // 3


def test_acceptance_summary():
    s = acceptance_summary(torch.tensor([0, 1, 2, 4, 4]), BLOCK)
    assert s["anchors"] == 5 and s["tau"] == pytest.approx(1 + 11 / 5)
    assert s["reach"] == pytest.approx([4 / 5, 3 / 5, 2 / 5, 2 / 5])
    assert s["conditional"] == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1.0])


def test_eval_drafter_script(tmp_path: Path):
    """The script on the default target and the shipped drafter: two held-out responses, the worker on one."""
    out = tmp_path / "eval.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_drafter.py"), "--dataset", "responses",
                    "--num-prompts", "2", "--max-new-tokens", "48", "--worker", "1", "--out", str(out)], check=True,
                   cwd=ROOT,
                   timeout=600)
    result = json.loads(out.read_text())["results"][0]
    names = set(result["proposers"])
    draft = next(n for n in names if n not in ("trigram", "lookup") and "/" not in n and "+" not in n)
    assert {"trigram", "lookup", f"lookup+{draft}", f"{draft} / context zeroed"} <= names
    assert sum(" zeroed" in n for n in names) == 1 + 5  # context, then each of the 5 target layers
    assert result["worker_prompts"] == 1 and 1.0 <= result["proposers"][draft]["worker_tau"] <= 16
    for s in result["proposers"].values():
        assert s["anchors"] > 50 and 1.0 <= s["tau"] <= 16
    assert out.with_suffix(".png").is_file()
