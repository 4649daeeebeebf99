"""Target features for training: teacher-forced prefill of whole sequences through our own
ModelRunner, capturing the residual stream after the drafter's target layers (optionally cached)."""

from __future__ import annotations

import torch

from sglang_dflash.runtime.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.runtime.model_runner import ModelRunner
from sglang_dflash.training.feature_cache import FeatureCache


@torch.inference_mode()
def target_pass(
    runner: ModelRunner, seqs: list[list[int]], layer_ids: tuple[int, ...], next_logits: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """[len(seq), K*H] features per sequence, computed as one ragged EXTEND batch, and with `next_logits` the
    target's next-token logits after every position ([len(seq), V] float32) from the same pass."""
    rows = [runner.req_to_token_pool.alloc() for _ in seqs]
    slots = runner.token_to_kv_pool_allocator.alloc(sum(map(len, seqs)))
    if slots is None or None in rows:
        raise RuntimeError("feature batch does not fit the runner's KV pool; use fewer or shorter sequences")
    try:
        start = 0
        for row, s in zip(rows, seqs):
            runner.req_to_token_pool.req_to_token[row, : len(s)] = slots[start : start + len(s)]
            start += len(s)
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, [t for s in seqs for t in s], rows, [0] * len(seqs), [len(s) for s in seqs],
            runner.req_to_token_pool.req_to_token, runner.device, logits="all" if next_logits else "none",
            capture_layer_ids=layer_ids,
        )
        out = runner.forward(fb)
        lens = [len(s) for s in seqs]
        nexts = list(out.next_token_logits.float().split(lens)) if next_logits else None
        return list(out.hidden_states.split(lens)), nexts
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)


def target_features(runner: ModelRunner, seqs: list[list[int]], layer_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """[len(seq), K*H] features per sequence (target_pass without the next tokens)."""
    return target_pass(runner, seqs, layer_ids)[0]


class TrainingFeatures:
    """Target features of training records, rounded to bfloat16 (as the cache stores them, so a run with
    the cache trains exactly like one without): from the cache when there is one (computing and adding the
    missing ones in one batch), otherwise computed; uncached, also the target's next-token logits."""

    def __init__(self, runner: ModelRunner, layer_ids: tuple[int, ...], cache: FeatureCache | None):
        self.runner, self.layer_ids, self.cache = runner, layer_ids, cache

    def __call__(
        self, recs: list[dict], seqs: list[list[int]], next_logits: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if next_logits and self.cache is not None:
            raise ValueError("the feature cache holds no logits: target labels train without --feature-cache")
        if self.cache is None:
            feats, nexts = target_pass(self.runner, seqs, self.layer_ids, next_logits)
            return [f.to(torch.bfloat16) for f in feats], nexts
        device = self.runner.device
        found = [self.cache.get(r["id"]) for r in recs]
        found = [None if f is None else f.to(device) for f in found]
        missing = [i for i, f in enumerate(found) if f is None or f.shape[0] != len(seqs[i])]
        if missing:
            for i, f in zip(missing, target_features(self.runner, [seqs[i] for i in missing], self.layer_ids)):
                found[i] = f.to(torch.bfloat16)
                self.cache.put(recs[i]["id"], found[i])
        return found, None

    @torch.no_grad()
    def rms(self, seqs: list[list[int]], batch: int) -> torch.Tensor:
        """Per-dimension RMS of the (unrounded) features of these sequences ([K*H], float32), `batch` at a time."""
        device = self.runner.device
        width = len(self.layer_ids) * self.runner.model_config.hidden_size
        if not seqs:
            return torch.ones(width, device=device)
        total, count = torch.zeros(width, device=device), 0
        for start in range(0, len(seqs), batch):
            for f in target_features(self.runner, seqs[start : start + batch], self.layer_ids):
                total += f.float().pow(2).sum(0)
                count += f.shape[0]
        return (total / count).sqrt().clamp_min(1e-3)
