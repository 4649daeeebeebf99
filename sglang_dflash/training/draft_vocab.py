"""Reduced draft vocabulary (optional checkpoint extension `dflash_config.draft_vocab`): the N most
frequent tokens of the target's own responses. The draft proposes only these; verification keeps
the output exact, and the draft's lm_head shrinks from V to N rows."""

from __future__ import annotations

from collections import Counter

import torch


def most_frequent_tokens(sequences: list[list[int]], size: int, always: list[int]) -> list[int]:
    """Sorted token ids: `always` plus the most frequent tokens, `size` in all."""
    counts = Counter(t for s in sequences for t in s)
    chosen = list(dict.fromkeys(always))
    for tok, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if tok not in chosen:
            chosen.append(tok)
    return sorted(chosen)


def coverage(sequences: list[list[int]], vocab: list[int]) -> float:
    keep = set(vocab)
    total = sum(len(s) for s in sequences)
    return sum(t in keep for s in sequences for t in s) / max(total, 1)


def target_to_draft_index(vocab: list[int], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: position of each target token in the draft vocab, -100 when absent."""
    index = torch.full((vocab_size,), -100, dtype=torch.int64)
    index[torch.tensor(vocab)] = torch.arange(len(vocab))
    return index
