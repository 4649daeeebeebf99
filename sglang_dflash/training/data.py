"""Training data: the records, their hash dev split, and the epoch order batches are drawn from.

The data may grow between runs (regeneration and training can overlap): records not seen before are
appended to the current epoch's order, and the order itself is part of the checkpoint."""

from __future__ import annotations

import hashlib
import random

import torch

from sglang_dflash.training.draft_vocab import coverage


def is_dev_record(record_id: str) -> bool:
    """About 2% of prompts, chosen by a hash of their id: the split stays put as data grows."""
    return int(hashlib.sha1(record_id.encode()).hexdigest(), 16) % 50 == 0


def sample_anchors(prompt_len: int, seq_len: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Anchor positions a in [prompt_len, seq_len - 2]: the block [x_a, MASK...] predicts x_(a+1).."""
    lo, hi = prompt_len, seq_len - 1
    n = hi - lo
    if n <= 0:
        return torch.empty(0, dtype=torch.int64)
    pick = torch.randperm(n, generator=gen)[: min(count, n)]
    return (lo + pick).sort().values


class TrainData:
    """Records by id, the dev set (fixed once the first batch is drawn, so the learning curve is measured
    on one set) and the training ids in this epoch's order, with a cursor into it."""

    def __init__(self, seed: int, dev_size: int, max_len: int):
        self.seed, self.dev_size, self.max_len = seed, dev_size, max_len
        self.records: dict[str, dict] = {}
        self.dev: list[dict] = []
        self.order: list[str] = []
        self.cursor, self.epoch = 0, 0
        self.dev_open = True

    def add(self, records: list[dict]) -> int:
        """Adds records of ids not seen before (dev ones to the dev set while it is open; the rest to the end of
        this epoch's order, shuffled); returns how many training records were added."""
        new = []
        for r in records:  # an id seen twice (in two response dirs, say) counts once
            if r["response_ids"] and r["id"] not in self.records:
                self.records[r["id"]] = r
                new.append(r)
        if self.dev_open:
            self.dev += [r for r in new if is_dev_record(r["id"])][: max(0, self.dev_size - len(self.dev))]
        fresh = [r["id"] for r in new if not is_dev_record(r["id"])]
        random.Random(f"{self.seed}-{len(self.order)}").shuffle(fresh)
        self.order += fresh
        return len(fresh)

    def responses(self) -> list[list[int]]:
        """Response token ids of every training record."""
        return [self.records[i]["response_ids"] for i in self.order]

    def vocab_coverage(self, vocab: list[int] | None) -> float | None:
        """Share of the training response tokens inside a draft vocabulary (None without one)."""
        return None if vocab is None else coverage(self.responses(), vocab)

    def sequence(self, rec: dict) -> tuple[list[int], int]:
        """Prompt + response ids cut to max_len, and the prompt's length within them."""
        ids = (rec["prompt_ids"] + rec["response_ids"])[: self.max_len]
        return ids, min(len(rec["prompt_ids"]), len(ids))

    def next_batch(self, n: int) -> list[dict]:
        self.dev_open = False
        batch = []
        while len(batch) < n:
            if self.cursor >= len(self.order):  # next epoch: a fresh shuffle of everything
                self.epoch, self.cursor = self.epoch + 1, 0
                random.Random(f"{self.seed}-epoch-{self.epoch}").shuffle(self.order)
            batch.append(self.records[self.order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self) -> dict:
        return {"order": self.order, "cursor": self.cursor, "epoch": self.epoch, "dev": [r["id"] for r in self.dev]}

    def load_state_dict(self, state: dict) -> None:
        """The saved order (of the records still present), then the records added since; the saved dev set."""
        known = [i for i in state["order"] if i in self.records]
        in_known = set(known)
        self.order = known + [i for i in self.order if i not in in_known]
        self.cursor, self.epoch = state["cursor"], state["epoch"]
        self.dev = [self.records[i] for i in state["dev"] if i in self.records]
        self.dev_open = False
