"""Batched sampling: penalties, temperature, top-k / top-p / min-p, inverse-CDF draws from
per-request seeded uniforms (so a seed fixes the output), greedy rows by argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dflash.device import upload
from sglang_dflash.kernels.argmax import argmax
from sglang_dflash.sampling.sampling_params import SamplingParams

FAST_K = 256  # candidates examined before falling back to a full sort


@dataclass
class SamplingBatchInfo:
    """Per-row sampling parameters as device tensors (one row per logits row)."""

    temperatures: torch.Tensor  # [n] float32 (greedy rows hold 1.0)
    top_ps: torch.Tensor
    top_ks: torch.Tensor  # int64, vocab size when disabled
    min_ps: torch.Tensor
    greedy: torch.Tensor  # [n] bool
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    all_greedy: bool
    sampled_rows: list[int] | None  # the rows that sample, known on the host (None in a select / expand)
    any_penalty: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingBatchInfo:
        """One non-blocking upload of a [8, n] float32 table (top-k and the greedy flag are exact in float32), cut
        into the per-parameter rows on the device."""
        greedy = [p.is_greedy for p in params]
        table = upload([
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            [p.top_p for p in params],
            [p.top_k if p.top_k > 0 else vocab_size for p in params],
            [p.min_p for p in params],
            [float(g) for g in greedy],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        ], torch.float32, device)
        return cls(
            temperatures=table[0],
            top_ps=table[1],
            top_ks=table[2].long(),
            min_ps=table[3],
            greedy=table[4] > 0,
            repetition=table[5],
            frequency=table[6],
            presence=table[7],
            all_greedy=all(greedy),
            sampled_rows=[i for i, g in enumerate(greedy) if not g],
            any_penalty=any(p.has_penalties for p in params),
            need_top_p=any(p.top_p < 1 for p in params),
            need_top_k=any(0 < p.top_k < vocab_size for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatchInfo:
        """The info of a subset of rows."""
        fields = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return SamplingBatchInfo(**{**fields, "sampled_rows": None})

    def expand(self, repeats: torch.Tensor, total: int) -> SamplingBatchInfo:
        """Per-request info -> per-row info, request i repeated repeats[i] times (total: their sum, known on the
        host, so the shape needs no sync)."""
        fields = {}
        for name, value in self.__dict__.items():
            expanded = isinstance(value, torch.Tensor)
            fields[name] = value.repeat_interleave(repeats, 0, output_size=total) if expanded else value
        return SamplingBatchInfo(**{**fields, "sampled_rows": None})


def apply_penalties(
    logits: torch.Tensor, info: SamplingBatchInfo, output_counts: torch.Tensor, seen_mask: torch.Tensor
) -> torch.Tensor:
    """output_counts [n, V]: counts of generated tokens before each row; seen_mask [n, V]: prompt or output.
    Repetition penalty (HF/SGLang rule) over seen tokens; frequency and presence (OpenAI) over output. Float32."""
    logits = logits.float()
    rep = info.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_mask, penalised, logits)
    logits = logits - info.frequency[:, None] * output_counts
    return logits - info.presence[:, None] * (output_counts > 0).to(logits.dtype)


def logits_to_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Temperature, softmax, then top-k, top-p and min-p masks on the sorted probs, renormalised.

    Exact fast path: the filters are evaluated on the top FAST_K tokens of each row, which decides
    every row whose kept set provably ends inside them; only the other rows are fully sorted."""
    probs = torch.softmax(logits.float() / info.temperatures[:, None], dim=-1)
    if not (info.need_top_k or info.need_top_p or info.need_min_p):
        return probs
    k = min(FAST_K, probs.shape[-1])
    top, order = probs.topk(k, dim=-1)
    keep = _filter_sorted(top, info)
    # a token past rank k survives only if the top-k filter, top-p mass and min-p bound all let it
    spill = (info.top_ks > k) & (top.sum(-1) <= info.top_ps) & (top[:, -1] >= top[:, 0] * info.min_ps)
    out = torch.zeros_like(probs).scatter_(-1, order, top * keep)
    rows = spill.nonzero().squeeze(1) if k < probs.shape[-1] else spill.new_zeros(0, dtype=torch.int64)
    if rows.numel():
        sorted_probs, full_order = probs[rows].sort(dim=-1, descending=True)
        sub = _filter_sorted(sorted_probs, info.select(rows))
        out[rows] = torch.zeros_like(sorted_probs).scatter_(-1, full_order, sorted_probs * sub)
    return out / out.sum(-1, keepdim=True)


def _filter_sorted(sorted_probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Keep-mask over probs sorted in descending order (ranks within the row)."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    keep = ranks[None, :] < info.top_ks[:, None]
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) <= info.top_ps[:, None]
    return keep & (sorted_probs >= sorted_probs[:, :1] * info.min_ps[:, None])


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first index whose cumulative probability exceeds u * total."""
    cdf = probs.cumsum(-1)
    u = (uniforms * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def draw_uniforms(generators: list[torch.Generator], per_req: int, device: torch.device) -> torch.Tensor:
    """[len(generators), per_req] float32 uniforms, each request from its own generator."""
    rows = [torch.rand(per_req, generator=g) for g in generators]
    return upload(torch.stack(rows), torch.float32, device)


def sample(logits: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor) -> torch.Tensor:
    """Next token per row (penalties already applied to logits); only sampled rows build a distribution."""
    greedy_ids = argmax(logits)
    if info.all_greedy:
        return greedy_ids
    rows = upload(info.sampled_rows, torch.int64, logits.device)
    sampled = sample_from_probs(logits_to_probs(logits[rows], info.select(rows)), uniforms[rows])
    return greedy_ids.index_copy(0, rows, sampled)


def penalty_state(
    output_ids: list[list[int]], prompt_ids: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output_counts [n, V] float32, seen_mask [n, V] bool) for rows with these token histories (two uploads)."""
    n = len(output_ids)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    out = upload([[i for i, ids in enumerate(output_ids) for _ in ids], [t for ids in output_ids for t in ids]],
                 torch.int64, device)
    prompt = upload([[i for i, ids in enumerate(prompt_ids) for _ in ids], [t for ids in prompt_ids for t in ids]],
                    torch.int64, device)
    counts.index_put_((out[0], out[1]), torch.ones(out.shape[1], device=device), accumulate=True)
    seen[out[0], out[1]] = True
    seen[prompt[0], prompt[1]] = True
    return counts, seen
