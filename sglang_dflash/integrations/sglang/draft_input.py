"""Draft-side state that SGLang carries between decode steps, and the decode-time KV reservation."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

PER_REQUEST = ("bonus_tokens", "new_seq_lens", "topk_p", "topk_index", "hidden_states")


@dataclass
class DFlashDraftInput(SpecInput):
    """bonus_tokens: the last token the target produced (in no KV cache yet); new_seq_lens: committed lengths.

    In overlap mode SGLang's FutureMap relays both by request slot and only `future_indices` travels with the
    batch. `topk_p`/`topk_index`/`hidden_states` are empty (bs, 0) tensors that SGLang's relay expects."""

    bonus_tokens: torch.Tensor  # [bs] int64
    new_seq_lens: torch.Tensor  # [bs] int64
    block_size: int
    future_indices: torch.Tensor | None = None  # set by the scheduler after dispatch
    topk_p: torch.Tensor = field(init=False)
    topk_index: torch.Tensor = field(init=False)
    hidden_states: torch.Tensor = field(init=False)

    def __post_init__(self):
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        self.num_tokens_per_req = self.num_tokens_for_logprob_per_req = 1
        self.bonus_tokens = self.bonus_tokens.to(torch.int64)
        self.new_seq_lens = self.new_seq_lens.to(torch.int64)
        empty = self.bonus_tokens.new_empty((self.bonus_tokens.shape[0], 0))
        self.topk_p, self.topk_index, self.hidden_states = empty.float(), empty, empty.float()

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        """Lagging over-allocation: reserve KV slots up to committed + 2B per request (the in-flight block and
        the next one, since the host learns accepted lengths one step late). Never frees; SGLang releases
        [committed, allocated) when the request ends."""
        batch.maybe_evict_swa()
        page = batch.token_to_kv_pool_allocator.page_size
        width = batch.req_to_token_pool.req_to_token.shape[1] // page * page
        reserve = 2 * self.block_size
        cur = [r.kv.kv_allocated_len for r in batch.reqs]
        want = [min(width, (r.kv.kv_committed_len + reserve + page - 1) // page * page) for r in batch.reqs]
        nxt = [max(c, w) for c, w in zip(cur, want)]
        for r in batch.reqs:
            r.decode_batch_idx += 1
        cur_cpu = torch.tensor(cur, dtype=torch.int32)
        nxt_cpu = torch.tensor(nxt, dtype=torch.int32)
        alloc_for_spec_decode(
            batch.tree_cache, batch.req_to_token_pool, reqs=batch.reqs, req_pool_indices=batch.req_pool_indices,
            cur_kv_lens=cur_cpu.to(batch.device, non_blocking=True), cur_kv_lens_cpu=cur_cpu,
            nxt_kv_lens=nxt_cpu.to(batch.device, non_blocking=True), nxt_kv_lens_cpu=nxt_cpu,
            num_needed_tokens=sum(nxt) - sum(cur), batch=batch,
        )

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None) -> None:
        if self.future_indices is not None:
            self.future_indices = self.future_indices[new_indices]
            return
        for name in PER_REQUEST:
            setattr(self, name, getattr(self, name)[new_indices])

    def merge_batch(self, other: DFlashDraftInput) -> None:
        if self.future_indices is not None:
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
            return
        for name in PER_REQUEST:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
