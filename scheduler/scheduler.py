"""Scheduler: a waiting queue and a running batch. Admission by KV budget and max running
requests, chunked prefill, retraction of the newest request when KV runs out, release on finish.
A radix cache keeps committed prefixes: admission matches the longest one, finished and retracted
requests insert theirs, and its unlocked leaves are evicted when the pool needs room."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Protocol

import torch

from sglang_dflash.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglang_dflash.mem_cache.radix_cache import EvictingAllocator, RadixCache
from sglang_dflash.runtime.forward_batch import ForwardMode
from sglang_dflash.scheduler.isolation import fail_culprits, forward_isolated, run_isolated
from sglang_dflash.scheduler.schedule_batch import GenerationBatchResult, Req, ScheduleBatch

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
        enable_overlap: bool = False,
        disable_radix_cache: bool = False,
        enable_mixed_chunk: bool = False,
    ):
        self.worker = worker
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = RadixCache(allocator, disable=disable_radix_cache)
        self.allocator = EvictingAllocator(allocator, self.tree_cache)  # free slots + evictable cached ones
        self.num_prefill_tokens = 0  # tokens prefilled (computed), recomputation after retraction included
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests (first admission only)
        self.num_cached_tokens = 0  # of those, tokens the radix cache served
        self.max_running_requests = min(max_running_requests, req_to_token_pool.size)
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting_queue: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted; prompt not fully cached (or its last chunk in flight)
        self.running: list[Req] = []  # decoding
        self.num_retractions = 0
        self.finished_by_error: list[Req] = []
        self.enable_overlap = enable_overlap
        self.enable_mixed_chunk = enable_mixed_chunk
        self.in_flight: tuple[ScheduleBatch, Future] | None = None
        self.launched = 0  # batches launched / completed, to know when freed memory is safe to reuse
        self.completed = 0
        self.deferred_frees: list[tuple[int, int, torch.Tensor]] = []  # (batch tag, req row, token slots)

    @property
    def lookahead_blocks(self) -> int:
        """Decode steps allocate for the block in flight and, with overlap, the next one."""
        return 2 if self.enable_overlap else 1

    # ---- requests in and out ----
    def add_request(self, req: Req) -> None:
        self.worker.validate_request(req)
        reach = self.lookahead_blocks * self.worker.tokens_per_decode_step(req)
        prompt, new = len(req.origin_input_ids), req.sampling_params.max_new_tokens
        if prompt + new + reach > self.allocator.size:  # it could never finish, even alone
            raise ValueError(
                f"max_tokens: {prompt} prompt tokens + {new} new tokens (+ {reach} in flight) do not fit the "
                f"KV cache pool of {self.allocator.size} tokens; lower max_tokens or shorten the prompt"
            )
        self.waiting_queue.append(req)

    def abort_request(self, rid: str, message: str = "aborted") -> Req | None:
        """Finishes a request wherever it is and frees its memory (once no in-flight batch uses it)."""
        for queue in (self.waiting_queue, self.prefilling, self.running):
            for req in queue:
                if req.rid == rid:
                    req.finish({"type": "abort", "message": message})
                    queue.remove(req)  # a decoding request's committed tokens stay cached
                    self.release(req, self.cacheable_len(req) if queue is self.running else 0)
                    return req
        return None

    def abort_all(self, message: str) -> list[Req]:
        """Finishes every request (shutdown, a failed step); returns them."""
        reqs = list(self.waiting_queue) + list(self.prefilling) + list(self.running)
        for req in reqs:
            self.abort_request(req.rid, message)
        return reqs

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.prefilling or self.running or self.in_flight)

    # ---- memory ----
    def cacheable_len(self, req: Req) -> int:
        """Leading tokens of a decoding (or just finished) request whose target KV and draft context KV are
        written: the committed ones, never the last token (no KV yet) nor speculative slots past them."""
        return 0 if self.tree_cache.disable else min(req.kv_committed_len, req.seq_len - 1)

    def match_prefix(self, req: Req) -> None:
        """Points a newly admitted request's row at its longest cached prefix and locks it. The last token
        is always computed (its logits give the next token), so at most seq_len - 1 tokens match."""
        slots, node = self.tree_cache.match_prefix(req.fill_ids[: req.seq_len - 1])
        self.tree_cache.lock(node)
        self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(slots)] = slots
        req.prefix_node, req.cached_len = node, len(slots)
        req.kv_committed_len = req.kv_allocated_len = len(slots)
        if not req.retracted_count:
            req.cached_tokens = len(slots)

    def cache_unfinished(self, req: Req) -> None:
        """Shares a request's prompt as soon as it is computed, while it decodes; unless another request
        cached more of it meanwhile (then it keeps its own slots until it finishes)."""
        n = self.cacheable_len(req)
        key = req.fill_ids[:n]
        if n <= req.cached_len or len(self.tree_cache.match_prefix(key)[0]) != req.cached_len:
            return
        self.tree_cache.insert(key, self.req_to_token_pool.req_to_token[req.req_pool_idx, :n])
        node = self.tree_cache.match_prefix(key)[1]
        self.tree_cache.lock(node)
        self.tree_cache.unlock(req.prefix_node)
        req.prefix_node, req.cached_len = node, n

    def release(self, req: Req, cache_len: int = 0) -> None:
        """Returns a request's row and slots: its first cache_len tokens go to the radix cache (see
        cacheable_len), the rest is freed once no launched batch may still use it."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        own = req.cached_len  # row[:own] belongs to the cache already
        if cache_len > own:  # row[own:cached] duplicates slots the cache had: freed
            cached = self.tree_cache.insert(req.fill_ids[:cache_len], row[:cache_len])
            slots = torch.cat([row[own:cached], row[cache_len : req.kv_allocated_len]])
        else:
            slots = row[own : req.kv_allocated_len]
        self.tree_cache.unlock(req.prefix_node)
        self.deferred_frees.append((self.launched, req.req_pool_idx, slots.clone()))
        req.req_pool_idx = req.prefix_node = None
        req.cached_len = req.kv_allocated_len = req.kv_committed_len = 0
        self.free_completed()

    def flush_cache(self) -> bool:
        """Empties the radix cache; refused (False) while requests wait or run, as in SGLang."""
        if self.waiting_queue or self.prefilling or self.running:
            return False
        self.land()
        self.free_completed()
        self.tree_cache.reset()
        return True

    def free_completed(self) -> None:
        keep = []
        for tag, row, slots in self.deferred_frees:
            if tag <= self.completed:
                self.allocator.free(slots)
                self.req_to_token_pool.free(row)
            else:
                keep.append((tag, row, slots))
        self.deferred_frees = keep

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
        """Frees a running request's KV (its committed tokens stay cached) and requeues it at the front; it is
        recomputed later, from what the cache still holds."""
        self.release(req, self.cacheable_len(req))
        req.retracted_count += 1
        self.num_retractions += 1
        self.waiting_queue.appendleft(req)
        logger.info("retracted %s (KV pool full)", req.rid)

    # ---- scheduling ----
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_prefill_batch()
        if batch is not None:
            return self.mix_with_running(batch) if self.enable_mixed_chunk and self.in_flight is None else batch
        return self.get_decode_batch()

    def mix_with_running(self, batch: ScheduleBatch) -> ScheduleBatch:
        """A prefill batch with every running request riding along as a 1-token extension (its last token; the
        host has it when no batch is in flight): one forward instead of a prefill step that stalls the decodes
        and then a decode step. The running requests decode plainly in that step (no speculation)."""
        riders = list(self.running)
        if not riders or not all(self.ensure_allocated(r, r.kv_committed_len + 1) for r in riders):
            return batch
        prefix_lens = [r.kv_committed_len for r in riders]
        for r in riders:
            r.kv_committed_len += 1  # as a prefill chunk: committed at schedule time
        return ScheduleBatch(batch.reqs + riders, ForwardMode.EXTEND, batch.prefix_lens + prefix_lens,
                             batch.extend_lens + [1] * len(riders))

    def decode_need(self, req: Req) -> int:
        return req.kv_committed_len + self.lookahead_blocks * self.worker.tokens_per_decode_step(req)

    def get_prefill_batch(self) -> ScheduleBatch | None:
        budget = self.chunked_prefill_size
        reqs, prefix_lens, extend_lens = [], [], []
        decode_reserve = sum(self.decode_need(r) - r.kv_allocated_len for r in self.running)

        def take(req: Req) -> bool:
            nonlocal budget
            n = min(req.seq_len - req.kv_committed_len, budget)
            reserve = decode_reserve + self.lookahead_blocks * self.worker.tokens_per_decode_step(req)
            grow = req.kv_committed_len + n - req.kv_allocated_len
            if self.allocator.available_size() - grow < reserve:
                return False
            if not self.ensure_allocated(req, req.kv_committed_len + n):
                return False
            self.num_prefill_tokens += n
            reqs.append(req)
            prefix_lens.append(req.kv_committed_len)
            extend_lens.append(n)
            req.kv_committed_len += n  # prefill results are deterministic: commit at schedule time
            budget -= n
            return True

        for req in self.prefilling:
            if req.seq_len - req.kv_committed_len > 0 and (budget <= 0 or not take(req)):
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
                self.match_prefix(req)
            if not take(req):
                self.release(req)
                break
            self.waiting_queue.popleft()
            self.prefilling.append(req)
            if not req.retracted_count:
                self.num_prompt_tokens += len(req.origin_input_ids)
                self.num_cached_tokens += req.cached_tokens
        if not reqs:
            return None
        return ScheduleBatch(reqs, ForwardMode.EXTEND, prefix_lens, extend_lens)

    def get_decode_batch(self) -> ScheduleBatch | None:
        """All running requests, after growing their KV; retracts the newest when the pool is full."""
        while self.running:
            short = [r for r in self.running if not self.ensure_allocated(r, self.decode_need(r))]
            if not short:
                return ScheduleBatch(list(self.running), ForwardMode.DECODE)
            if self.in_flight is not None:  # retraction frees KV: first let the in-flight batch land
                return None
            newest = max(self.running, key=lambda r: r.created_time)
            self.running.remove(newest)
            if not self.running:
                newest.finish({"type": "abort", "message": "KV cache is too small for this request"})
                self.release(newest)
                self.finished_by_error.append(newest)
            else:
                self.retract(newest)
        return None

    # ---- steps ----
    def run_step(self) -> list[Req]:
        """One iteration of the loop (overlapped or plain, as configured); the requests it touched."""
        return self.step_overlap() if self.enable_overlap else self.step()

    def land(self) -> list[Req]:
        """Runs until no batch is in flight, so the host has every result."""
        touched = []
        while self.in_flight is not None:
            touched += self.run_step()
        return touched

    def step(self) -> list[Req]:
        """Runs one batch and processes it; returns the requests that got tokens or finished."""
        self.finished_by_error = []
        batch = self.get_next_batch_to_run()
        if batch is None:
            return self.finished_by_error
        batch, result, failed = run_isolated(self, batch)  # a request that breaks the batch fails alone
        touched = self.finished_by_error + failed
        return touched + (self.process_batch_result(batch, result) if batch is not None else [])

    def step_overlap(self) -> list[Req]:
        """Spec-V2 style: launch batch N, then process batch N-1 while the device runs N. A decode step makes no
        host-device sync (its one wait is N-1's result read, here), so on an asynchronous device the launch
        returns once N's work is queued; on the CPU it runs N to the end first (one thread, one thread team)."""
        self.finished_by_error = []
        needs_history = any(r.sampling_params.has_penalties for r in self.running)
        batch = None if (needs_history and self.in_flight) else self.get_next_batch_to_run()
        launched = None
        if batch is not None:
            batch.host_current = self.in_flight is None
            self.launched += 1
            launched = (batch, launch(self.worker, batch))  # a request that breaks the batch fails alone
        touched = list(self.finished_by_error)
        prev, self.in_flight = self.in_flight, launched
        if prev is not None:
            try:
                outcome = prev[1].result()
            finally:
                self.completed += 1
            touched += fail_culprits(self, outcome)
            if outcome.batch is not None:
                touched += self.process_batch_result(outcome.batch, outcome.result)
        return touched

    def drain(self) -> None:
        """Waits for the batch in flight and drops its results (after its requests were aborted)."""
        if self.in_flight is not None:
            _, fut = self.in_flight
            self.in_flight = None
            fut.exception()  # waits; an error of an aborted batch is moot
            self.completed += 1
        self.free_completed()

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> list[Req]:
        tokens_per_req, accept_lens = result.resolve()
        touched = []
        for i, req in enumerate(batch.reqs):
            tokens = tokens_per_req[i]
            if req.finished() or req.req_pool_idx is None:  # aborted or retracted while in flight
                continue
            if not batch.forward_mode.is_extend():
                req.kv_committed_len += len(tokens)
                if accept_lens is not None:
                    record_spec_step(req, accept_lens[i], result.block_sizes[i], result.plans[i].source)
            for t in tokens:
                req.append_token(t)
                if req.finished():
                    break
            if tokens:
                touched.append(req)
                if req in self.prefilling:
                    self.prefilling.remove(req)
                    self.running.append(req)
                    if not req.finished():
                        self.cache_unfinished(req)
            if req.finished():
                self.running.remove(req)
                self.release(req, self.cacheable_len(req))
        self.free_completed()
        return touched


def launch(worker: Worker, batch: ScheduleBatch) -> Future:
    """Runs `batch` (queues its work on an asynchronous device); its outcome, or its error, when processed."""
    future: Future = Future()
    try:
        future.set_result(forward_isolated(worker, batch))
    except Exception as e:  # noqa: BLE001 - raised where the batch is processed, as a device error would be
        future.set_exception(e)
    return future


def record_spec_step(req: Req, accepted: int, block_size: int, source: str) -> None:
    """Counts one verify step that committed accepted + 1 tokens out of a block of block_size."""
    req.spec_verify_ct += 1
    req.spec_accepted_drafts += accepted
    req.spec_draft_slots += block_size - 1
    for hist in (req.spec_histogram, req.spec_block_histogram):
        if len(hist) < block_size:
            hist.extend([0] * (block_size - len(hist)))
    req.spec_histogram[accepted] += 1
    req.spec_block_histogram[block_size - 1] += 1
    req.spec_sources[source] = req.spec_sources.get(source, 0) + 1
