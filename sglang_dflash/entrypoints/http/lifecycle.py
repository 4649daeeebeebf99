"""Serving and graceful shutdown. On SIGTERM (or SIGINT) the server stops admitting requests (the listening
socket closes, a request on an open connection gets a 503), lets the running ones finish for up to
--shutdown-grace-s, then ends the rest with an explicit error (a 503 body, or an error event in a stream)
and exits with code 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI

from sglang_dflash.entrypoints.http.scheduler_thread import SchedulerThread
from sglang_dflash.entrypoints.http.tokenizer_manager import AsyncTokenizerManager
from sglang_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)

CLOSE_MARGIN_S = 5.0  # after the grace period: time for the ended requests to send their error and close


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tm: AsyncTokenizerManager, scheduler_thread: SchedulerThread,
                 grace_s: float):
        super().__init__(config)
        self.tm, self.scheduler_thread, self.grace_s = tm, scheduler_thread, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.tm.draining = True
        running = self.tm.num_in_flight
        logger.info("shutting down: %d requests get up to %.1fs to finish", running, self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.end_the_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def end_the_rest(self) -> None:
        if self.tm.num_in_flight:
            logger.warning("shutdown grace period over: ending %d requests", self.tm.num_in_flight)
        self.scheduler_thread.end_all(f"the server shut down ({self.grace_s:g}s grace period over)", 503)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()  # uvicorn re-raises them at exit: a graceful stop exits 0


def serve(app: FastAPI, args: ServerArgs) -> None:
    """Serves until SIGTERM / SIGINT, then shuts down gracefully (see the module docstring)."""
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=5,
        timeout_graceful_shutdown=args.shutdown_grace_s + CLOSE_MARGIN_S,
    )
    logger.info("serving on http://%s:%d", args.host, args.port)
    GracefulServer(config, app.state.tm, app.state.scheduler_thread, args.shutdown_grace_s).run()
