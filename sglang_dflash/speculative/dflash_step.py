"""DFlashStep: THE DFlash decode step, shared by our engine's worker and the SGLang worker.

    plan (host)  ->  propose  ->  host.verify  ->  accept  ->  materialise  ->  StepOutput

Per request the plan picks a source (DFlash, context lookup, or none) and a block length. DFlash rows run
one draft forward over [bonus, MASK, ...]; lookup rows take their n-gram continuation; the target verifies
every block in one forward; the committed rows' draft context K/V is materialised from the verify pass's
captured features, so DFlash can resume at any step whatever the source was. That materialisation waits for
the next draft forward (or prefill, or MAX_PENDING_TOKENS): steps without a draft forward (lookup or plain rows,
most steps under load) do not pay for it, and the waiting steps' tokens go through one GEMM. Where the policy finds
that no DFlash block could pay at the batch's size (`SpecPolicy.materialise`), the committed tokens' features are
parked instead (up to MAX_PARKED_BYTES, the oldest dropped) and the requests stop drafting (`ReqSpecState.drafts`);
once a block could pay again (the batch has shrunk), the first decode step writes the parked draft context K/V of the
slots its requests hold, drops the rest, and lets every request whose context is then complete draft again
(`resume`). The step marks which slots hold draft K/V (`written`): the radix cache keeps every committed token, so a
request whose cached prefix has slots without draft K/V does not draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_dflash.device import HostCopy, upload
from sglang_dflash.mem_cache.memory_pool import MHATokenToKVPool
from sglang_dflash.models.dflash import DFlashDraftModel, block_input_ids
from sglang_dflash.sampling.sampler import SamplingBatchInfo
from sglang_dflash.speculative.accept import accept, point_masses
from sglang_dflash.speculative.draft_block import DraftBlock
from sglang_dflash.speculative.policy import DFLASH, LOOKUP, Plan, ReqSpecState, SpecPolicy

MAX_PENDING_TOKENS = 2048  # committed tokens whose draft context K/V may wait (their features: ~6 KB each)
MAX_PARKED_BYTES = 256 << 20  # features kept while nothing is materialised (SmolLM2-135M: ~46k tokens)


class VerifyHost(Protocol):
    """What a host gives the step: the target's verify forward and the sampling of its requests."""

    def verify(self, block: DraftBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over every request's block -> (logits [T, V] with the host's logit adjustments
        (penalties, logit bias, grammar) applied, captured features [T, F]) of the T verified tokens, in
        `block.rows` order (`block.verified` turns a host's padded [bs, W, ...] rows into these). The features
        must stay as they are until a later step (no buffer a later forward overwrites)."""
        ...

    def sampling(self, block: DraftBlock) -> tuple[SamplingBatchInfo | None, torch.Tensor | None]:
        """(sampling info, uniforms [bs, W + 1]) of the batch; (None, None) when every request is greedy."""
        ...


@dataclass
class StepOutput:
    accept_lens: torch.Tensor  # [bs] accepted drafts
    next_bonus: torch.Tensor  # [bs] the token sampled after the last accepted one
    out_tokens: torch.Tensor  # [bs, W] committed tokens (bonus, accepted drafts, next bonus), -1 padded
    new_seq_lens: torch.Tensor  # [bs] committed KV length after this step
    block_lens: list[int]
    plans: list[Plan]


class DFlashStep:
    def __init__(self, draft: DFlashDraftModel, draft_pool: MHATokenToKVPool, policy: SpecPolicy):
        self.draft = draft
        self.draft_pool = draft_pool
        self.policy = policy
        self.unobserved: list[tuple[list[ReqSpecState], list[Plan], HostCopy]] = []  # steps not yet learnt from
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (features, positions, slots)
        self.pending_tokens = 0
        self.max_pending_tokens = MAX_PENDING_TOKENS
        self.max_parked_bytes = MAX_PARKED_BYTES
        self.parked = False  # tokens were parked since the last `resume`
        self.resumed: list[tuple[list[ReqSpecState], HostCopy]] = []  # whose context `resume` completed
        self.written = torch.zeros(draft_pool.k_buffer.shape[1], dtype=torch.bool, device=draft_pool.k_buffer.device)

    def plan(self, reqs: list, host_current: bool, limits: list[int]) -> tuple[list[ReqSpecState], list[Plan]]:
        """The policy's plan for the next step of the host's requests (anything with `spec_state`,
        `origin_input_ids` and `output_ids`), after learning from the earlier steps whose accepted counts have
        reached the host (never waiting for one: with a batch in flight it learns a step later). Lookup needs the
        host's token lists to include every earlier step (`host_current`); limits: each request's largest block."""
        while self.unobserved and self.unobserved[0][2].ready():
            prev_states, prev_plans, accept_lens = self.unobserved.pop(0)
            self.policy.observe(prev_states, prev_plans, accept_lens.host.tolist())
        while self.resumed and self.resumed[0][1].ready():
            resumed_states, complete = self.resumed.pop(0)
            for st, ok in zip(resumed_states, complete.host.tolist()):
                st.drafts = ok
        for r in reqs:
            if getattr(r, "spec_state", None) is None:  # a new (or recomputed) request starts from the prior
                r.spec_state = self.policy.new_state()
        states = [r.spec_state for r in reqs]
        histories = [(r.origin_input_ids, r.output_ids) for r in reqs] if host_current else None
        return states, self.policy.plan(states, histories, limits)

    # ---- prefill and commit ----
    def prefill(self, reqs: list, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: list[int] | torch.Tensor, prefix_lens: list[int]) -> None:
        """A prefill (chunk) of the host's requests (prefix_lens: the tokens before the chunk, cached or earlier
        chunks): their proposer states, and the draft context K/V of its tokens where the policy materialises (else
        they are parked and the requests stop drafting until `resume`). A request whose prefix has a slot without
        draft K/V stops drafting too (one host read, where some prefix is reused)."""
        for r in reqs:
            if getattr(r, "spec_state", None) is None:
                r.spec_state = self.policy.new_state()
        if self.policy.materialise:
            self.materialize(features, positions, out_cache_loc)
        else:
            self.park(features, positions, out_cache_loc)
            for r in reqs:
                r.spec_state.drafts = False
        reused = [i for i, (r, n) in enumerate(zip(reqs, prefix_lens)) if n and r.spec_state.drafts]
        if reused:
            prefixes = [req_to_token[req_pool_indices[i], : prefix_lens[i]].long() for i in reused]
            complete = torch.stack([self.written[slots].all() for slots in prefixes])
            for i, ok in zip(reused, complete.tolist()):
                reqs[i].spec_state.drafts = ok

    def materialize(self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """Draft context K/V of every draft layer for these tokens, from the target's captured features, now
        (after the waiting ones: a slot freed and reused since is written in order)."""
        self.flush()
        self._write(features, positions, out_cache_loc)

    def defer(self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """`materialize`, at the next draft forward, prefill or MAX_PENDING_TOKENS at the latest."""
        self.pending.append((features, positions, out_cache_loc))
        self.pending_tokens += positions.shape[0]
        if self.pending_tokens >= self.max_pending_tokens:
            self.flush()

    def flush(self) -> None:
        """Writes the waiting draft context K/V in one GEMM. A slot committed twice meanwhile (freed, then
        reused by another request) keeps its last write; the earlier ones go to the padding slot 0."""
        if not self.pending:
            return
        if len(self.pending) == 1:
            (features, positions, slots), = self.pending
        else:
            features, positions, slots = (torch.cat(x) for x in zip(*self.pending))
            slots = last_writes(slots, self.draft_pool.k_buffer.shape[1])
        self.pending, self.pending_tokens = [], 0
        self._write(features, positions, slots)

    def park(self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """`defer` while nothing is materialised: kept until `resume` (or a flush), the oldest dropped (their slots
        marked unwritten) past max_parked_bytes."""
        self.parked = True
        self.resumed = []  # stale: the requests stop drafting again
        self.pending.append((features, positions, out_cache_loc))
        self.pending_tokens += positions.shape[0]
        row_bytes = features.shape[1] * features.element_size()
        while self.pending_tokens * row_bytes > self.max_parked_bytes:
            _, oldest, slots = self.pending.pop(0)
            self.pending_tokens -= oldest.shape[0]
            self.written[slots] = False

    def resume(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               states: list[ReqSpecState], kv_bound: int) -> None:
        """Once the policy materialises again after tokens were parked: writes the waiting draft context K/V of the
        slots the batch's requests hold, drops the rest (marked unwritten: finished requests' tokens, which the radix
        cache may keep); every request whose context is then complete drafts from the next `plan` on. No host sync:
        the rows kept go first and at most as many rows as the batch holds slots are written (the others to slot 0)."""
        self.parked = False
        context = req_to_token[req_pool_indices, :kv_bound].long()
        held = torch.arange(kv_bound, device=context.device) < seq_lens[:, None]
        context = torch.where(held, context, 0)  # slot 0 pads
        if self.pending:
            features, positions, slots = (torch.cat(x) for x in zip(*self.pending))
            slots = last_writes(slots, self.written.shape[0])
            live = torch.zeros_like(self.written)
            live[context] = True
            live[0] = False
            keep = live[slots]
            self.written[slots] = False
            rows = torch.argsort(keep.logical_not().to(torch.uint8), stable=True)[: min(len(slots), context.numel())]
            slots = torch.where(keep[rows], slots[rows], 0)
            self.pending, self.pending_tokens = [], 0
            self._write(features[rows], positions[rows], slots)
        complete = (self.written[context] | ~held).all(dim=1)
        self.resumed.append((states, HostCopy(complete)))
        for st in states:  # this step's committed tokens are written; the next `plan` stops the incomplete ones
            st.drafts = True

    def unwritten(self, slots: torch.Tensor) -> None:
        """Marks slots committed without draft K/V (after the waiting writes, which would mark them written)."""
        self.flush()
        self.written[slots] = False

    def _write(self, features: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        self.draft.materialize_context_kv(
            features, positions, out_cache_loc, self.draft_pool.k_buffer, self.draft_pool.v_buffer
        )
        self.written[out_cache_loc] = True

    # ---- decode ----
    def decode(
        self, host: VerifyHost, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        bonus: torch.Tensor, states: list[ReqSpecState], plans: list[Plan], kv_bound: int,
    ) -> StepOutput:
        if self.parked and self.policy.materialise:
            self.resume(req_to_token, req_pool_indices, seq_lens, states, kv_bound)
        block_lens = [p.block_len for p in plans]
        block = DraftBlock.build(req_to_token, req_pool_indices, seq_lens, bonus, block_lens)
        draft = self.propose(block, plans, req_to_token, kv_bound, host)
        logits, features = host.verify(block)
        info, uniforms = host.sampling(block)
        accept_lens, next_bonus, out_tokens = accept(block, logits, info, uniforms, draft)
        self.commit(block, states, features, accept_lens)
        self.unobserved.append((states, plans, HostCopy(accept_lens)))
        return StepOutput(accept_lens, next_bonus, out_tokens, seq_lens + accept_lens + 1, block_lens, plans)

    def commit(self, block: DraftBlock, states: list[ReqSpecState], features: torch.Tensor,
               accept_lens: torch.Tensor) -> None:
        """Defers the draft context K/V of the committed tokens of the requests that draft (the others' slots are
        marked unwritten); parks every request's where the policy does not materialise (they stop drafting)."""
        committed_loc = torch.where(block.committed(accept_lens), block.out_cache_loc, 0)  # the rest to slot 0
        positions, slots = block.verified(block.positions), block.verified(committed_loc)
        if not self.policy.materialise:
            for st in states:
                st.drafts = False
            self.park(features, positions, slots)
            return
        drafting = [i for i, st in enumerate(states) if st.drafts]
        if not drafting:
            self.unwritten(slots)
            return
        if len(drafting) < len(states):
            self.unwritten(slots[block.token_rows([i for i, st in enumerate(states) if not st.drafts])])
            rows = block.token_rows(drafting)
            features, positions, slots = features.index_select(0, rows), positions[rows], slots[rows]
        self.defer(features, positions, slots)

    def propose(
        self, block: DraftBlock, plans: list[Plan], req_to_token: torch.Tensor, kv_bound: int, host: VerifyHost,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fills columns 1.. of the candidates: lookup continuations from the host, DFlash drafts from one
        draft forward over the DFlash rows. A drafter that samples its paths (DFlash 2) does so for the
        host's sampled requests (uniforms from `host.sampling`) and returns the batch's sparse draft
        distributions (candidate ids, q) [bs, W, K] for the accept; otherwise None (point masses)."""
        if block.width == 1:
            return None
        device = block.candidates.device
        rows = [i for i, p in enumerate(plans) if p.source == LOOKUP]
        if rows:
            pad = block.width - 1
            toks = [plans[i].lookup_tokens + [0] * (pad - len(plans[i].lookup_tokens)) for i in rows]
            block.candidates[upload(rows, torch.int64, device), 1:] = upload(toks, torch.int64, device)
        rows = [i for i, p in enumerate(plans) if p.source == DFLASH]
        if not rows:
            return None
        idx = upload(rows, torch.int64, device)
        block_lens = [plans[i].block_len for i in rows]
        args = (req_to_token, block.req_pool_indices[idx], block.candidates[idx, 0], block.seq_lens[idx], block_lens,
                kv_bound)
        info, uniforms = host.sampling(block) if self.draft.samples_paths else (None, None)
        if info is None:
            drafts = self.draft_block(*args)
        else:
            temperatures = torch.where(info.greedy, 0.0, info.temperatures)[idx]
            drafts, (ids, q) = self.draft_block(*args, sampling=(temperatures, uniforms[idx, : max(block_lens) - 1]))
        block.candidates[idx, 1 : drafts.shape[1] + 1] = drafts
        if info is None:
            return None
        draft = point_masses(block.candidates, ids.shape[-1])
        draft[0][idx, : ids.shape[1]] = ids
        draft[1][idx, : ids.shape[1]] = q
        return draft

    def draft_block(
        self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, bonus: torch.Tensor,
        seq_lens: torch.Tensor, block_lens: list[int], kv_bound: int,
        sampling: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Draft tokens [n, W - 1] (W = max block_lens): one draft forward over the padded blocks
        [bonus, MASK, ...]. Each block writes its own K/V into its slots (rewritten by context K/V once
        committed). `sampling` (temperatures [n], 0 = greedy; uniforms [n, W - 1]) samples a DFlash 2 drafter's
        paths; then (drafts, (candidate ids, q) [n, W - 1, K]) is returned."""
        self.flush()  # the draft forward reads the context K/V
        blk = DraftBlock.build(req_to_token, req_pool_indices, seq_lens, bonus, block_lens)
        n, width = blk.candidates.shape
        input_ids = block_input_ids(bonus, width, self.draft.config.mask_token_id)
        kv_indices = req_to_token[req_pool_indices, :kv_bound].long()
        hidden = self.draft(
            input_ids.flatten(), blk.positions.flatten(), blk.out_cache_loc.flatten(), kv_indices,
            seq_lens + blk.block_lens, width, self.draft_pool.k_buffer, self.draft_pool.v_buffer,
        )
        drafts, dist = self.draft.propose(hidden.view(n, width, -1)[:, 1:], bonus, *(sampling or (None, None)))
        return drafts if sampling is None else (drafts, dist)


def last_writes(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """slots [N] with every write but the last to each slot sent to slot 0 (no host sync)."""
    order = torch.arange(slots.shape[0], device=slots.device)
    last = torch.full((num_slots,), -1, dtype=torch.int64, device=slots.device)
    last.scatter_reduce_(0, slots, order, "amax")
    return torch.where(last[slots] == order, slots, 0)
