"""Verification of a draft block against the target: greedy matching or lossless rejection sampling, and the
block penalty history (row j of a block sees the drafts d1..dj before it, as plain decoding would).

A proposal is a point mass (DFlash's argmax or a context lookup), so the rejection rule is the same for
every proposer: accept d_j with probability p_j(d_j), else sample the bonus from the residual. A DFlash 2
drafter that samples its paths brings sparse draft distributions q over its K candidates instead: accept with
probability min(1, p/q), residual max(p - q, 0); the other rows' proposals are then K-wide point masses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_dflash.device import upload
from sglang_dflash.kernels import greedy_accept, sampling_accept, sparse_sampling_accept
from sglang_dflash.kernels.argmax import argmax
from sglang_dflash.sampling.sampler import SamplingBatchInfo, logits_to_probs
from sglang_dflash.speculative.draft_block import DraftBlock


def accept(
    block: DraftBlock, logits: torch.Tensor, info: SamplingBatchInfo | None, uniforms: torch.Tensor | None,
    draft: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted drafts [bs], next bonus [bs], committed tokens [bs, B] -1 padded) for the logits [T, V] of the
    block's verified tokens. `info` None means every request is greedy; else `uniforms` [bs, B + 1] drive the
    rejection sampler. Only greedy argmaxes, or sampled requests' probabilities, are padded to the block.
    `draft`: the sparse distributions (candidate ids, q) [bs, B, K] the drafts were sampled from; None: every
    draft is a point mass."""
    if info is None or info.all_greedy:
        if block.width == 1:  # plain decode rows only (most steps under load): nothing to verify
            bonus = argmax(logits)
            return torch.zeros_like(bonus), bonus, bonus[:, None]
        return greedy_accept(block.candidates, block.padded(argmax(logits)), block.block_lens)
    reqs = info.sampled_rows
    if len(reqs) == block.batch_size:
        return _sampled_accept(block, logits, info, uniforms[:, : block.width], uniforms[:, block.width], draft)
    # a mixed batch: every request by argmax first, then the sampled ones (only they build distributions)
    accept_lens, next_bonus, out_tokens = greedy_accept(block.candidates, block.padded(argmax(logits)),
                                                        block.block_lens)
    sub = block.select(reqs)
    idx = upload(reqs, torch.int64, logits.device)
    if draft is not None:
        draft = (draft[0][idx, : sub.width], draft[1][idx, : sub.width])
    lens, bonus, tokens = _sampled_accept(sub, logits[block.token_rows(reqs)], info.select(idx),
                                          uniforms[idx, : sub.width], uniforms[idx, block.width], draft)
    accept_lens[idx], next_bonus[idx] = lens, bonus
    out_tokens[idx] = F.pad(tokens, (0, block.width - sub.width), value=-1)
    return accept_lens, next_bonus, out_tokens


def _sampled_accept(
    block: DraftBlock, logits: torch.Tensor, info: SamplingBatchInfo, u: torch.Tensor, bonus_u: torch.Tensor,
    draft: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling of a block whose requests all sample: the target distribution of every verified row
    as the plain sampler defines it (temperature, top-k, top-p, min-p), padded to the block."""
    probs = block.padded(logits_to_probs(logits, info.expand(block.block_lens, block.num_tokens)))
    if draft is None:
        return sampling_accept(probs, block.candidates, block.block_lens, u, bonus_u)
    return sparse_sampling_accept(probs, block.candidates, block.block_lens, *draft, u, bonus_u)


def point_masses(candidates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts of candidates [bs, B] as sparse distributions (ids, q) [bs, B, k]: row j holds d_{j+1} with
    q = 1, its other k - 1 slots repeat it with q = 0; the last row is unused."""
    drafts = torch.cat([candidates[:, 1:], candidates[:, -1:]], dim=1)
    ids = drafts[:, :, None].expand(-1, -1, k).contiguous()
    q = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    q[:, :, 0] = 1.0
    return ids, q


def block_history(counts: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Output-token counts before each row of a block: counts [bs, V] of the committed outputs plus the
    drafts d1..dj before row j -> [bs, B, V]. Row 0 (the bonus row) sees only the committed outputs; the
    bonus itself is already among the outputs."""
    bs, _ = candidates.shape
    drafts = F.one_hot(candidates[:, 1:], counts.shape[-1]).to(counts.dtype)
    before = torch.cat([counts.new_zeros(bs, 1, counts.shape[-1]), drafts.cumsum(1)], dim=1)
    return counts[:, None] + before
