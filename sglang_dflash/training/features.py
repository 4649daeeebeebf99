"""Target features for training: teacher-forced prefill of whole sequences through our own
ModelRunner, capturing the residual stream after the drafter's target layers."""

from __future__ import annotations

import torch

from sglang_dflash.engine.forward_batch import ForwardBatch, ForwardMode
from sglang_dflash.engine.model_runner import ModelRunner


@torch.inference_mode()
def target_features(runner: ModelRunner, seqs: list[list[int]], layer_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """[len(seq), K*H] features per sequence, computed as one ragged EXTEND batch."""
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
            runner.req_to_token_pool.req_to_token, runner.device, logits="none", capture_layer_ids=layer_ids,
        )
        hidden = runner.forward(fb).hidden_states
        return list(hidden.split([len(s) for s in seqs]))
    finally:
        runner.token_to_kv_pool_allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)
