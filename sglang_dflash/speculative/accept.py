"""Verification of a draft block against the target: greedy matching or lossless rejection sampling, and the
block penalty history (row j of a block sees the drafts d1..dj before it, as plain decoding would).

A proposal is a point mass (DFlash's argmax or a context lookup), so the rejection rule is the same for
every proposer: accept d_j with probability p_j(d_j), else sample the bonus from the residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.kernels import greedy_accept, sampling_accept
from sglang_dflash.sampling.sampler import SamplingBatchInfo, logits_to_probs


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Verify logits [bs, B, V] -> the target distribution of every row, as the plain sampler defines it
    (temperature, top-k, top-p, min-p); greedy requests get one-hot argmax rows."""
    bs, block, vocab = logits.shape
    flat = logits.reshape(bs * block, vocab)
    row_info = info.expand(torch.full((bs,), block, device=logits.device))
    probs = logits_to_probs(flat, row_info)
    probs = torch.where(row_info.greedy[:, None], F.one_hot(flat.argmax(-1), vocab).to(probs.dtype), probs)
    return probs.view(bs, block, vocab)


def accept(
    candidates: torch.Tensor, block_lens: torch.Tensor, logits: torch.Tensor, info: SamplingBatchInfo | None,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted drafts [bs], next bonus [bs], committed tokens [bs, B] -1 padded) for logits [bs, B, V].
    `info` None means every request is greedy; else `uniforms` [bs, B + 1] drive the rejection sampler."""
    bs, block, _ = logits.shape
    if info is None or info.all_greedy:
        return greedy_accept(candidates, logits.argmax(-1), block_lens)
    probs = target_probs(logits, info)
    return sampling_accept(probs, candidates, block_lens, uniforms[:, :block], uniforms[:, block])


def block_history(counts: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Output-token counts before each row of a block: counts [bs, V] of the committed outputs plus the
    drafts d1..dj before row j -> [bs, B, V]. Row 0 (the bonus row) sees only the committed outputs; the
    bonus itself is already among the outputs."""
    bs, _ = candidates.shape
    drafts = F.one_hot(candidates[:, 1:], counts.shape[-1]).to(counts.dtype)
    before = torch.cat([counts.new_zeros(bs, 1, counts.shape[-1]), drafts.cumsum(1)], dim=1)
    return counts[:, None] + before
