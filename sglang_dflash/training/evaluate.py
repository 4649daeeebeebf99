"""How well a drafter drafts: tau measured with the real DFlashWorker (`dev_tau`: our Engine, greedy, one batch,
the drafter's own proposals at its full block size every step: no adaptive blocks, no context lookup), and
teacher-forced acceptance from every position of given greedy responses (`drafter_runs`)."""

from __future__ import annotations

from pathlib import Path

import torch

from sglang_dflash.entrypoints.engine import Engine
from sglang_dflash.models.dflash import DFlashDraftModel
from sglang_dflash.training.block_attention import draft_blocks_forward
from sglang_dflash.training.draft_vocab import target_to_draft_index
from sglang_dflash.training.loss import block_labels


def dev_tau(
    checkpoint: Path, prompts: list[list[int]], model_path: str | None, max_new_tokens: int, device: str = "cpu"
) -> float:
    """Mean over prompts of the committed tokens per verify step (bonus included), as the DFlash paper's tau."""
    if not prompts:
        return float("nan")
    longest = max(map(len, prompts)) + max_new_tokens
    engine = Engine(
        model_path=model_path, device=device, dtype="auto", speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(checkpoint), speculative_adaptive=False, speculative_lookup=False,
        max_running_requests=len(prompts),
        max_total_tokens=len(prompts) * (longest + 64), disable_overlap_schedule=True,
    )
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    taus = [o["meta_info"].get("spec_accept_length", 1.0) for o in outs]
    return sum(taus) / len(taus)


def accepted_runs(hits: torch.Tensor) -> torch.Tensor:
    """[m] accepted drafts per block from hits [m, L] (a run stops at the first miss)."""
    return hits.long().cumprod(1).sum(1)


@torch.no_grad()
def drafter_runs(
    draft: DFlashDraftModel, features: torch.Tensor, ids: list[int], prompt_len: int, stride: int = 1
) -> torch.Tensor:
    """Teacher-forced accepted run length of a drafter's greedy drafts at every `stride`-th anchor a in
    [prompt_len, len - 2]: the block [x_a, MASK, ...] over the context features of positions < a (features
    [len, K*H] as the target gives them to public-format weights)."""
    block, device = draft.config.block_size, features.device
    input_ids = torch.tensor(ids, device=device)
    anchors = torch.arange(prompt_len, len(ids) - 1, stride, device=device)
    h = draft_blocks_forward(draft, features, input_ids, anchors, block)
    x = draft.norm(h).view(len(anchors), block, -1)[:, 1:]
    logits = draft.head_logits(x)
    labels = block_labels(input_ids, anchors, block)
    if draft.config.draft_vocab is not None:
        index = target_to_draft_index(draft.config.draft_vocab, draft.config.vocab_size).to(device)
        labels = torch.where(labels >= 0, index[labels.clamp_min(0)], -100)
    prev = block_labels(input_ids, anchors - 1, block).clamp_min(0)
    hits = (draft.teacher_forced_drafts(x, logits, prev) == labels) & (labels >= 0)
    return accepted_runs(hits)


def acceptance_summary(runs: torch.Tensor, block: int) -> dict:
    """tau (accepted + 1 per block), the share of blocks whose run reaches position k (marginal acceptance)
    and the acceptance at k given k - 1 was reached (conditional), k = 1 .. block - 1."""
    runs = runs.float()
    reach = [float((runs >= k).float().mean()) for k in range(1, block)]
    before = [1.0, *reach[:-1]]
    conditional = [r / b if b > 0 else float("nan") for r, b in zip(reach, before)]
    return {"anchors": len(runs), "tau": float(runs.mean()) + 1.0, "reach": reach, "conditional": conditional}
