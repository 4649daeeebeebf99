"""AsyncTokenizerManager: the HTTP side of a request. Tokenises and validates it on a worker thread (off
the event loop), admits it within the queue bound, hands it to the scheduler thread, and yields its
outputs; a request whose client went away, or that is past its deadline (--request-timeout-s), is aborted
at once (its KV freed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from sglang_dflash.entrypoints.http.errors import RequestError
from sglang_dflash.entrypoints.http.scheduler_thread import ReqOutput, SchedulerThread
from sglang_dflash.entrypoints.tokenizer_manager import TokenizerManager
from sglang_dflash.scheduler.schedule_batch import Req

DISCONNECT_POLL_S = 1.0
RETRY_AFTER_S = 1
T = TypeVar("T")


class AsyncTokenizerManager:
    def __init__(self, tokenizer_manager: TokenizerManager, scheduler_thread: SchedulerThread,
                 max_in_flight: int | None = None, request_timeout_s: float | None = None):
        self.tm = tokenizer_manager
        self.scheduler_thread = scheduler_thread
        self.max_in_flight = max_in_flight  # running + queued requests; more get a 503
        self.request_timeout_s = request_timeout_s  # from the request's arrival (Req creation); None: no deadline
        self.num_in_flight = 0
        self.draining = False  # shutting down: no new requests
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")  # one thread: HF tokenizers

    @property
    def context_length(self) -> int:
        return self.tm.context_length

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the tokenizer thread: tokenising a big prompt does not block the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def encode(self, text: str) -> list[int]:
        return self.tm.encode(text)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tm.chat_ids(messages)

    def fit_kv_pool(self, req: Req) -> None:
        """For a request without max_tokens (up to the end of the context): no more than the KV pool holds."""
        sched = self.scheduler_thread.scheduler
        reach = sched.lookahead_blocks * sched.worker.tokens_per_decode_step(req)
        room = sched.allocator.size - reach - len(req.origin_input_ids)
        req.sampling_params.max_new_tokens = max(1, min(req.sampling_params.max_new_tokens, room))

    def make_req(
        self, prompt: str | None = None, input_ids: list[int] | None = None, sampling_params: dict | None = None,
        rid: str | None = None,
    ) -> Req:
        """A validated Req; ValueError (a 400) names what is wrong, e.g. a request beyond the context."""
        return self.tm.make_req(prompt, input_ids, sampling_params, rid)

    @property
    def timeout_message(self) -> str:
        return f"the request timed out after {self.request_timeout_s:g}s (--request-timeout-s; time queued counts)"

    def admit(self, n: int = 1) -> None:
        if self.draining:
            raise RequestError(503, "the server is shutting down", {"Retry-After": str(RETRY_AFTER_S)})
        if self.max_in_flight is not None and self.num_in_flight + n > self.max_in_flight:
            raise RequestError(
                503, f"the server is busy: {self.num_in_flight} requests running or queued (the bound is "
                f"{self.max_in_flight}, --max-running-requests + --max-queued-requests); retry later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )

    async def generate(self, req: Req, request: Request | None = None) -> AsyncGenerator[ReqOutput, None]:
        """Outputs of `req` until it finishes. A refused request raises ValueError before any output; one
        ended by the server (shutdown, a failure in its batch, its deadline) raises RequestError."""
        self.admit()
        out: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self.scheduler_thread.add(req, asyncio.get_running_loop(), out)
        self.num_in_flight += 1
        done = False
        why = "client disconnected"
        deadline = None if self.request_timeout_s is None else req.created_time + self.request_timeout_s
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while not done:
                left = DISCONNECT_POLL_S if deadline is None else deadline - time.perf_counter()
                try:
                    item = await asyncio.wait_for(out.get(), max(0.0, min(left, DISCONNECT_POLL_S)))
                except asyncio.TimeoutError:
                    item = None
                if deadline is not None and time.perf_counter() >= deadline and (item is None or not item.finished):
                    why = self.timeout_message
                    raise RequestError(504, why)
                if request is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                done = item.finished
                if item.error is not None:
                    raise ValueError(item.error)
                status = (item.finished_reason or {}).get("status_code")
                if status is not None:
                    raise RequestError(status, item.finished_reason["message"])
                yield item
        finally:
            self.num_in_flight -= 1
            if not done:
                self.scheduler_thread.abort(req.rid, why)

    async def generate_all(self, req: Req, request: Request | None = None) -> tuple[str, list[int], ReqOutput]:
        """Runs `req` to the end: (text, output_ids, last output)."""
        text, ids, last = [], [], None
        async for item in self.generate(req, request):
            text.append(item.text)
            ids.extend(item.output_ids)
            last = item
        if last is None:
            raise ClientDisconnect  # the client went away before the request finished
        return "".join(text), ids, last
