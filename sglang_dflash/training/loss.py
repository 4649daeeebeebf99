"""DFlash training loss: weighted cross-entropy over the B-1 predicted positions of each block; DFlash 2 adds
the candidate selector's K-way cross-entropy."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang_dflash.models.dflash2 import CandidateSelector


def position_weights(block: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (position 0 is the given token)."""
    k = torch.arange(1, block, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block: int) -> float:
    """7 for B=16, 5 for B=10, 4 for B=8 (the published choices); interpolated otherwise."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block, max(1.0, math.log2(block) * 1.75))


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[m, B-1] labels x_(a+1)..x_(a+B-1); -100 past the end of the sequence."""
    pos = anchors[:, None] + torch.arange(1, block, device=anchors.device)[None, :]
    valid = pos < input_ids.shape[0]
    return torch.where(valid, input_ids[pos.clamp(max=input_ids.shape[0] - 1)], -100)


def weighted_block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits [m, B-1, V], labels [m, B-1] (-100 = ignore), weights [B-1] -> scalar."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
    w = (weights[None, :] * (labels != -100)).flatten()
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def soft_block_targets(probs: torch.Tensor, anchors: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions for labels x_(a+1)..x_(a+B-1): rows a..a+B-2 of probs [n, V] (row i = the
    distribution of token i+1) -> [m, B-1, V], and where they exist [m, B-1] (a label inside the sequence)."""
    pos = anchors[:, None] + torch.arange(0, block - 1, device=anchors.device)[None, :]
    valid = pos < probs.shape[0] - 1
    return probs[pos.clamp(max=probs.shape[0] - 2)], valid


def weighted_soft_block_loss(
    logits: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:
    """Position-weighted cross-entropy against the target's distributions: logits and probs [m, B-1, V],
    valid [m, B-1], weights [B-1] -> scalar."""
    ce = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    w = weights[None, :] * valid
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def selector_candidates(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's training candidates [m, L, K] (draft ids) and the gold's index among them: the top-K of
    logits [m, L, V], the last replaced by the gold label [m, L] where the gold falls outside."""
    top = logits.topk(top_k, dim=-1).indices
    gold = labels.clamp_min(0)[..., None]
    outside = (labels >= 0) & ~(top == gold).any(-1)
    top = torch.cat([top[..., :-1], torch.where(outside[..., None], gold, top[..., -1:])], dim=-1)
    return top, (top == gold).int().argmax(-1)


def selector_loss(
    selector: CandidateSelector, x: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
    to_target: Callable[[torch.Tensor], torch.Tensor], weights: torch.Tensor,
) -> torch.Tensor:
    """Position-weighted K-way cross-entropy of the selector's teacher-forced scores: x [m, L, H] normed states,
    logits [m, L, V] (draft vocabulary), labels [m, L] (draft ids, -100 = ignore), prev [m, L] the gold
    predecessors (target ids); `to_target` maps draft ids to the target ids the codebooks index."""
    top, target = selector_candidates(logits, labels, selector.top_k)
    scores = selector.teacher_forced_scores(x, logits.gather(-1, top), to_target(top), prev)
    ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none")
    w = (weights[None, :] * (labels >= 0)).flatten()
    return (ce * w).sum() / w.sum().clamp_min(1e-6)
