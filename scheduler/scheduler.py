"""Scheduler: a waiting queue and a running batch. Admission by KV budget and max running
requests, chunked prefill, retraction of the newest request when KV runs out, release on finish."""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch

from sglang_dflash.engine.forward_batch import ForwardMode
from sglang_dflash.engine.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)


class Worker(Protocol):
    def tokens_per_decode_step(self, req: Req) -> int: ...

    def validate_request(self, req: Req) -> None: ...

    def forward_batch_generation(self, batch: ScheduleBatch) -> GenerationBatchResult: ...


class Scheduler:
    def __init__(
        self,
        worker: Worker,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        max_running_requests: int,
        chunked_prefill_size: int,
    ):
        self.worker = worker
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.max_running_requests = min(max_running_requests, req_to_token_pool.size)
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting_queue: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully cached yet
        self.running: list[Req] = []  # decoding
        self.num_retractions = 0
        self.finished_by_error: list[Req] = []

    # ---- requests in and out ----
    def add_request(self, req: Req) -> None:
        self.worker.validate_request(req)
        need = req.seq_len + self.worker.tokens_per_decode_step(req)
        if need > self.allocator.size:
            raise ValueError(
                f"prompt of {req.seq_len} tokens does not fit the KV pool ({self.allocator.size} tokens)"
            )
        self.waiting_queue.append(req)

    def abort_request(self, rid: str, message: str = "aborted") -> Req | None:
        """Finishes a request wherever it is and frees its memory at once."""
        for queue in (self.waiting_queue, self.prefilling, self.running):
            for req in queue:
                if req.rid == rid:
                    req.finish({"type": "abort", "message": message})
                    queue.remove(req)
                    self.release(req)
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.prefilling or self.running)

    def num_requests(self) -> int:
        return len(self.waiting_queue) + len(self.prefilling) + len(self.running)

    # ---- memory ----
    def release(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        if req.kv_allocated_len:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self.allocator.free(row[: req.kv_allocated_len])
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_allocated_len = 0
        req.kv_committed_len = 0

    def ensure_allocated(self, req: Req, length: int) -> bool:
        """Grows the request's slots to `length` tokens; False when the pool is out of slots."""
        extra = length - req.kv_allocated_len
        if extra <= 0:
            return True
        slots = self.allocator.alloc(extra)
        if slots is None:
            return False
        self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_allocated_len : length] = slots
        req.kv_allocated_len = length
        return True

    def retract(self, req: Req) -> None:
        """Frees a running request's KV and requeues it at the front; it is recomputed later."""
        self.release(req)
        req.retracted_count += 1
        self.num_retractions += 1
        self.waiting_queue.appendleft(req)
        logger.info("retracted %s (KV pool full)", req.rid)

    # ---- scheduling ----
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_prefill_batch()
        if batch is not None:
            return batch
        return self.get_decode_batch()

    def get_prefill_batch(self) -> ScheduleBatch | None:
        budget = self.chunked_prefill_size
        reqs, prefix_lens, extend_lens = [], [], []
        decode_reserve = sum(self.worker.tokens_per_decode_step(r) for r in self.running)

        def take(req: Req) -> bool:
            nonlocal budget
            remaining = req.seq_len - req.kv_committed_len
            n = min(remaining, budget)
            reserve = decode_reserve + self.worker.tokens_per_decode_step(req)
            if n <= 0 or self.allocator.available_size() - (req.kv_committed_len + n - req.kv_allocated_len) < reserve:
                return False
            if not self.ensure_allocated(req, req.kv_committed_len + n):
                return False
            reqs.append(req)
            prefix_lens.append(req.kv_committed_len)
            extend_lens.append(n)
            budget -= n
            return True

        for req in list(self.prefilling):
            if budget <= 0 or not take(req):
                break
        while self.waiting_queue and budget > 0:
            if len(self.running) + len(self.prefilling) >= self.max_running_requests:
                break
            req = self.waiting_queue[0]
            if req.req_pool_idx is None:
                idx = self.req_to_token_pool.alloc()
                if idx is None:
                    break
                req.req_pool_idx = idx
            if not take(req):
                self.release(req)
                break
            self.waiting_queue.popleft()
            self.prefilling.append(req)
        if not reqs:
            return None
        return ScheduleBatch(reqs, ForwardMode.EXTEND, prefix_lens, extend_lens)

    def get_decode_batch(self) -> ScheduleBatch | None:
        while self.running:
            newest = None
            for req in self.running:
                if not self.ensure_allocated(req, req.kv_committed_len + self.worker.tokens_per_decode_step(req)):
                    newest = max(self.running, key=lambda r: r.created_time)
                    break
            if newest is None:
                return ScheduleBatch(list(self.running), ForwardMode.DECODE)
            if len(self.running) == 1:
                self.running.remove(newest)
                newest.finish({"type": "abort", "message": "KV cache is too small for this request"})
                self.release(newest)
                self.finished_by_error.append(newest)
                continue
            self.running.remove(newest)
            self.retract(newest)
        return None

    # ---- one step ----
    def step(self) -> list[Req]:
        """Runs one batch; returns the requests that got new tokens or finished this step."""
        self.finished_by_error = []
        batch = self.get_next_batch_to_run()
        if batch is None:
            return self.finished_by_error
        result = self.worker.forward_batch_generation(batch)
        return self.finished_by_error + self.process_batch_result(batch, result)

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> list[Req]:
        touched = []
        for i, req in enumerate(batch.reqs):
            tokens = result.next_token_ids[i]
            if batch.forward_mode.is_extend():
                req.kv_committed_len = batch.prefix_lens[i] + batch.extend_lens[i]
            else:
                req.kv_committed_len += len(tokens)
            if req.finished():  # aborted while in flight
                continue
            if result.accept_lens is not None and not batch.forward_mode.is_extend():
                record_spec_step(req, result.accept_lens[i], result.block_sizes[i])
            for t in tokens:
                req.append_token(int(t))
                if req.finished():
                    break
            if tokens:
                touched.append(req)
                if req in self.prefilling:
                    self.prefilling.remove(req)
                    if not req.finished():
                        self.running.append(req)
            if req.finished():
                if req in self.running:
                    self.running.remove(req)
                self.release(req)
        return touched


def record_spec_step(req: Req, accepted: int, block_size: int) -> None:
    """Counts one verify step that committed accepted + 1 tokens out of a block of block_size."""
    req.spec_verify_ct += 1
    req.spec_accepted_drafts += accepted
    req.spec_draft_slots += block_size - 1
    if len(req.spec_histogram) < block_size:
        req.spec_histogram.extend([0] * (block_size - len(req.spec_histogram)))
    req.spec_histogram[accepted] += 1

