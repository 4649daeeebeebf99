"""SGLang's penalties (frequency, presence, repetition, min_new_tokens) applied exactly to every verify row.

SGLang's own speculative path counts one output token per step; row j of a DFlash block must see every
committed output token, the bonus and the drafts d1..dj before it, as plain decoding would. The output
token counts live on the device, one row per request slot, so the overlap loop needs no host history.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_dflash.speculative.accept import block_history


def has_penalties(params: Any) -> bool:
    return (
        params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


def stop_token_ids(req: Any) -> list[int]:
    """The tokens SGLang's min_new_tokens penalizer blocks."""
    tok = req.tokenizer
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    ids |= set(tok.additional_stop_token_ids or ())
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(i for i in ids if i is not None)


class PenaltyState:
    """Output-token counts [request slots, V], kept for requests with penalties only."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.counts = torch.zeros(slots, vocab, dtype=torch.float32, device=device)

    def start(self, reqs: list[Any], first_tokens: torch.Tensor) -> None:
        """At prefill: the outputs so far (non-empty after a retraction) plus the first sampled token."""
        for i, req in enumerate(reqs):
            if not has_penalties(req.sampling_params):
                continue
            row = self.counts[req.kv.req_pool_idx]
            row.zero_()
            history = torch.tensor(req.output_ids, dtype=torch.int64, device=row.device)
            row.index_add_(0, history, torch.ones_like(history, dtype=row.dtype))
            row.index_add_(0, first_tokens[i : i + 1].to(torch.int64), row.new_ones(1))

    def commit(self, rpi: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Adds the first counts[i] of tokens[i] (the tokens emitted this step) to request i's history."""
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
        rows = rpi[:, None].expand_as(tokens)
        self.counts.index_put_((rows[valid], tokens[valid]), torch.ones_like(tokens[valid], dtype=torch.float32),
                               accumulate=True)

    def apply(
        self, logits: torch.Tensor, reqs: list[Any], rpi: torch.Tensor, candidates: torch.Tensor,
        prefix: torch.Tensor,
    ) -> None:
        """In place on logits [bs, B, V], for the requests with penalties, in SGLang's order: additive
        (frequency, presence, min_new_tokens), then repetition scaling."""
        sel = [i for i, r in enumerate(reqs) if has_penalties(r.sampling_params)]
        if not sel:
            return
        device = logits.device
        block, vocab = logits.shape[1], logits.shape[2]
        idx = torch.tensor(sel, device=device)
        params = [reqs[i].sampling_params for i in sel]

        def per_req(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None, None]

        counts = block_history(self.counts[rpi[idx]], candidates[idx])  # [n, B, V]: outputs before each row
        rows = logits[idx]
        rows -= per_req([p.frequency_penalty for p in params]) * counts
        rows -= per_req([p.presence_penalty for p in params]) * (counts > 0)
        prompt_lens = torch.tensor([len(reqs[i].origin_input_ids) for i in sel], device=device)
        out_lens = (prefix[idx] - prompt_lens + 1)[:, None] + torch.arange(block, device=device)
        blocked = out_lens < torch.tensor([p.min_new_tokens for p in params], device=device)[:, None]
        stops = torch.zeros(len(sel), vocab, dtype=torch.bool, device=device)
        for k, i in enumerate(sel):
            stops[k, stop_token_ids(reqs[i])] = True
        rows.masked_fill_(blocked[:, :, None] & stops[:, None, :], float("-inf"))
        rep = per_req([p.repetition_penalty for p in params]).expand_as(rows)
        scaled = torch.where(rows < 0, rows * rep, rows / rep)
        logits[idx] = torch.where(counts > 0, scaled, rows)
