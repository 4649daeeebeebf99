"""Server-sent events: `data: {json}` lines ending with `data: [DONE]`, in a response that always closes
its generator, so a request whose client went away is aborted at once rather than when it is collected."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from sglang_dflash.entrypoints.http.errors import RequestError, error_body
from sglang_dflash.entrypoints.http.scheduler_thread import ReqOutput

DONE = "data: [DONE]\n\n"


def sse(item: BaseModel | dict) -> str:
    body = item.model_dump_json(exclude_none=True) if isinstance(item, BaseModel) else json.dumps(item)
    return f"data: {body}\n\n"


class SSEResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[str, None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events = events

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.events.aclose()


def stream_outputs(
    first: ReqOutput, outputs: AsyncIterator[ReqOutput], render: Callable[[ReqOutput], Iterable[BaseModel | dict]],
    opening: Iterable[BaseModel | dict] = (),
) -> SSEResponse:
    """The events of one request: `opening`, then render(out) for every output; a request the server ends
    (shutdown, a failure in its batch) closes with an error event; always `[DONE]` last."""

    async def events() -> AsyncGenerator[str, None]:
        try:
            for item in opening:
                yield sse(item)
            out = first
            while out is not None:
                for item in render(out):
                    yield sse(item)
                out = None if out.finished else await anext(outputs, None)
        except RequestError as e:
            yield sse(error_body(e.status, e.message))
        finally:
            await outputs.aclose()
        yield DONE

    return SSEResponse(events())
