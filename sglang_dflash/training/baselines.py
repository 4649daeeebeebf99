"""Proposers a drafter must beat, measured teacher-forced like it (see evaluate.py): an n-gram model counted
from the training responses, and the context lookup the engine itself uses (`speculative.lookup`)."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from sglang_dflash.speculative.lookup import NgramIndex


class TrigramModel:
    """The most frequent next token after the last two tokens (backing off to the last one, then to the most
    frequent token), counted from training sequences."""

    def __init__(self, sequences: list[list[int]]):
        tri: dict[tuple[int, int], Counter] = defaultdict(Counter)
        bi: dict[int, Counter] = defaultdict(Counter)
        uni: Counter = Counter()
        for s in sequences:
            uni.update(s)
            for a, b in zip(s, s[1:]):
                bi[a][b] += 1
            for a, b, c in zip(s, s[1:], s[2:]):
                tri[(a, b)][c] += 1
        self.tri = {k: c.most_common(1)[0][0] for k, c in tri.items()}
        self.bi = {k: c.most_common(1)[0][0] for k, c in bi.items()}
        self.top = uni.most_common(1)[0][0] if uni else 0

    def next(self, a: int, b: int) -> int:
        return self.tri.get((a, b), self.bi.get(b, self.top))

    def runs(self, ids: list[int], prompt_len: int, block: int) -> torch.Tensor:
        """Accepted run length at every anchor a in [prompt_len, len - 2]: position k of the block predicted from
        the two gold tokens before it (the run only continues while the drafts are the gold)."""
        out = []
        for a in range(prompt_len, len(ids) - 1):
            run = 0
            for t in range(a + 1, min(a + block, len(ids))):
                if self.next(ids[t - 2], ids[t - 1]) != ids[t]:
                    break
                run += 1
            out.append(run)
        return torch.tensor(out, dtype=torch.int64)


def lookup_runs(
    ids: list[int], prompt_len: int, block: int, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted run length, suffix-match length n; 0 = no proposal) of the engine's context lookup at every
    anchor a in [prompt_len, len - 2], over prompt + the response up to a."""
    index = NgramIndex(min_n, max_n)
    index.extend(ids[:prompt_len])
    runs, matches = [], []
    for a in range(prompt_len, len(ids) - 1):
        index.extend([ids[a]])
        proposal, n = index.propose(block - 1)
        run = 0
        for tok, gold in zip(proposal, ids[a + 1 :]):
            if tok != gold:
                break
            run += 1
        runs.append(run)
        matches.append(n)
    return torch.tensor(runs, dtype=torch.int64), torch.tensor(matches, dtype=torch.int64)
