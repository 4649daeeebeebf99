"""SchedulerThread: runs the (not thread-safe) Scheduler in one dedicated thread.

Commands (add, abort) come in through a thread-safe queue; outputs go out to per-request asyncio queues
with `loop.call_soon_threadsafe`. Each output carries only what is new since the previous one.

All of the server's torch work runs on this thread: building the model, the warm-up and every step. Torch
work on a second thread starts a second OpenMP team; with more OpenMP threads than cores, libgomp stops
spinning between parallel regions and sleeps instead, and a batch-1 decode step on a 2-core CPU took 1.6x
as long (53 vs 33 ms; model built and warmed up on the main thread, steps on this one).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from sglang_dflash.entrypoints.http.metrics import Metrics
from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReqOutput:
    """New streamable text and token ids of a request since its previous output."""

    rid: str
    text: str
    output_ids: list[int]
    finished_reason: dict | None
    meta_info: dict
    error: str | None = None  # set when the scheduler refused the request (nothing was generated)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A consistent snapshot taken by the scheduler thread after each loop iteration."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    available_kv_tokens: int = 0  # free + evictable: what new requests can get
    max_total_num_tokens: int = 0
    num_retractions: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0  # total time inside scheduler steps
    host_gap_s: float = 0.0  # total time between consecutive steps while there was work
    num_host_gaps: int = 0
    free_kv_tokens: int = 0  # slots in no request and not in the radix cache
    radix_cache_tokens: int = 0  # slots the radix cache holds: evictable + locked by running requests
    evictable_kv_tokens: int = 0  # cached slots no running request locks
    num_prefill_tokens: int = 0  # tokens prefilled (computed) since start
    num_cached_tokens: int = 0  # prompt tokens the radix cache served since start
    cache_hit_rate: float = 0.0  # num_cached_tokens / prompt tokens of admitted requests


@dataclass
class AddReq:
    req: Req
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


@dataclass
class AbortReq:
    rid: str
    message: str


@dataclass
class EndAll:
    """Ends every request with an error of this HTTP status (the shutdown grace period is over)."""

    message: str
    status: int


@dataclass
class FlushCache:
    """Empties the radix cache; `done` gets True, or False while requests wait or run."""

    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class Sink:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


STOP = object()


class SchedulerThread:
    def __init__(self, build: Callable[[], Scheduler], metrics: Metrics | None = None):
        """Starts the thread, which calls `build` (model, warm-up) and then serves commands; returns once the
        scheduler is built, raising what `build` raised."""
        self.metrics = metrics
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}
        self.last_step_end: float | None = None
        self.num_steps = 0
        self.step_time_s = 0.0
        self.host_gap_s = 0.0
        self.num_host_gaps = 0
        built: Future[None] = Future()
        self.thread = threading.Thread(target=self.run, args=(build, built), name="scheduler", daemon=True)
        self.thread.start()
        built.result()  # self.scheduler is set

    # ---- called from the HTTP thread ----
    def add(self, req: Req, loop: asyncio.AbstractEventLoop, out: asyncio.Queue) -> None:
        self.commands.put(AddReq(req, loop, out))

    def abort(self, rid: str, message: str) -> None:
        self.commands.put(AbortReq(rid, message))

    def end_all(self, message: str, status: int) -> None:
        self.commands.put(EndAll(message, status))

    async def flush_cache(self) -> bool:
        """Empties the radix cache on the scheduler thread; False while requests wait or run."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.commands.put(FlushCache(loop, done))
        return await done

    def shutdown(self) -> None:
        self.commands.put(STOP)
        self.thread.join(timeout=30)

    # ---- the scheduler thread ----
    def run(self, build: Callable[[], Scheduler], built: Future[None]) -> None:
        try:
            self.scheduler = build()
            self.update_stats()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        while True:
            idle = not self.scheduler.has_work()
            if idle:
                self.last_step_end = None
            try:
                if not self.drain_commands(block=idle):
                    break
                if self.scheduler.has_work():
                    self.run_step()
            except Exception:
                logger.exception("scheduler loop failed: aborting every request")
                self.end_all_now("internal error: the scheduler step failed (see the server log)", 500)
            self.update_stats()
        self.abort_all("server shutdown")
        self.scheduler.drain()

    def end_all_now(self, message: str, status: int) -> None:
        sched = self.scheduler
        for req in [*sched.waiting_queue, *sched.prefilling, *sched.running]:
            req.finish({"type": "abort", "message": message, "status_code": status})
        self.abort_all(message)

    def abort_all(self, message: str) -> None:
        for req in self.scheduler.abort_all(message):
            self.send_output(req)
        self.last_step_end = None

    def drain_commands(self, block: bool) -> bool:
        """Handles every queued command (waiting for one if `block`); False on STOP."""
        cmds = [self.commands.get()] if block else []
        while not self.commands.empty():
            cmds.append(self.commands.get())
        for cmd in cmds:
            if cmd is STOP:
                return False
            if isinstance(cmd, AddReq):
                self.add_now(cmd)
            elif isinstance(cmd, EndAll):
                self.end_all_now(cmd.message, cmd.status)
            elif isinstance(cmd, FlushCache):
                flushed = False
                try:  # landing the batch in flight may raise: the caller still gets its answer
                    flushed = self.scheduler.flush_cache()
                finally:
                    cmd.loop.call_soon_threadsafe(cmd.done.set_result, flushed)
            else:
                self.abort_now(cmd.rid, cmd.message)
        return True

    def add_now(self, cmd: AddReq) -> None:
        req = cmd.req
        try:
            if req.rid in self.sinks:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            self.scheduler.add_request(req)
        except Exception as e:  # ValueError: the request can never run here; anything else: log it too
            if not isinstance(e, ValueError):
                logger.exception("could not add request %s", req.rid)
            out = ReqOutput(req.rid, "", [], {"type": "abort", "message": str(e)}, req.meta_info(), error=str(e))
            cmd.loop.call_soon_threadsafe(cmd.out.put_nowait, out)
            return
        self.sinks[req.rid] = Sink(cmd.loop, cmd.out)
        if self.metrics is not None:
            self.metrics.on_admitted(req)

    def abort_now(self, rid: str, message: str) -> None:
        req = self.scheduler.abort_request(rid, message)
        if req is not None:
            self.send_output(req)

    def run_step(self) -> None:
        start = time.perf_counter()
        gap = None if self.last_step_end is None else start - self.last_step_end
        retractions = self.scheduler.num_retractions
        touched = self.scheduler.run_step()
        end = time.perf_counter()
        for req in touched:
            self.send_output(req)
        self.last_step_end = end
        self.num_steps += 1
        self.step_time_s += end - start
        if gap is not None:
            self.host_gap_s += gap
            self.num_host_gaps += 1
        if self.metrics is not None:
            if gap is not None:
                self.metrics.host_gap.observe(gap)
            self.metrics.num_retractions.inc(self.scheduler.num_retractions - retractions)

    def send_output(self, req: Req) -> None:
        """Sends a request's new text and ids to its HTTP handler; the last output carries finished_reason."""
        sink = self.sinks.get(req.rid)
        if sink is None:
            return
        new = req.take_delta()
        if new is None:
            return
        delta, ids = new
        out = ReqOutput(req.rid, delta, ids, req.finished_reason, req.meta_info())
        sink.loop.call_soon_threadsafe(sink.out.put_nowait, out)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(ids))
        if req.finished():
            del self.sinks[req.rid]
            if self.metrics is not None:
                self.metrics.on_finished(req)

    def update_stats(self) -> None:
        sched = self.scheduler
        running = len(sched.running)
        waiting = len(sched.waiting_queue) + len(sched.prefilling)
        available = sched.allocator.available_size()
        cache = sched.tree_cache
        hit_rate = sched.num_cached_tokens / max(sched.num_prompt_tokens, 1)
        self.stats = SchedulerStats(
            running, waiting, available, sched.allocator.size, sched.num_retractions, self.num_steps,
            self.step_time_s, self.host_gap_s, self.num_host_gaps,
            free_kv_tokens=sched.allocator.allocator.available_size(), radix_cache_tokens=cache.total_size(),
            evictable_kv_tokens=cache.evictable_size, num_prefill_tokens=sched.num_prefill_tokens,
            num_cached_tokens=sched.num_cached_tokens, cache_hit_rate=hit_rate,
        )
        if self.metrics is not None:
            self.metrics.on_step(running, waiting, sched.allocator.size - available, sched.allocator.size)
            self.metrics.on_cache(cache.evictable_size, hit_rate)
