"""AsyncTokenizerManager: the HTTP side of a request. Tokenises and validates it, hands it to the
scheduler thread, and yields its outputs; a request whose client went away is aborted at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from starlette.requests import ClientDisconnect, Request

from sglang_dflash.engine.tokenizer_manager import TokenizerManager
from sglang_dflash.scheduler.schedule_batch import Req
from sglang_dflash.server.scheduler_thread import ReqOutput, SchedulerThread

DISCONNECT_POLL_S = 1.0


class AsyncTokenizerManager:
    def __init__(self, tokenizer_manager: TokenizerManager, scheduler_thread: SchedulerThread):
        self.tm = tokenizer_manager
        self.scheduler_thread = scheduler_thread

    @property
    def context_length(self) -> int:
        return self.tm.context_length

    def encode(self, text: str) -> list[int]:
        return self.tm.encode(text)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tm.chat_ids(messages)

    def make_req(
        self, prompt: str | None = None, input_ids: list[int] | None = None, sampling_params: dict | None = None,
        rid: str | None = None,
    ) -> Req:
        """A validated Req; ValueError (a 400) names what is wrong, e.g. a request beyond the context."""
        req = self.tm.make_req(prompt, input_ids, sampling_params, rid)
        total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{total} tokens ({len(req.origin_input_ids)} in the prompt, {req.sampling_params.max_new_tokens} "
                "for the completion). Please reduce the length of the prompt or of max_tokens."
            )
        return req

    async def generate(self, req: Req, request: Request | None = None) -> AsyncGenerator[ReqOutput, None]:
        """Outputs of `req` until it finishes. A refused request raises ValueError before any output."""
        out: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self.scheduler_thread.add(req, asyncio.get_running_loop(), out)
        done = False
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while not done:
                try:
                    item = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    item = None
                if request is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                done = item.finished
                if item.error is not None:
                    raise ValueError(item.error)
                yield item
        finally:
            if not done:
                self.scheduler_thread.abort(req.rid, "client disconnected")

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
