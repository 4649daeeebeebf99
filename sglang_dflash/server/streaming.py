"""Server-sent events: `data: {json}` lines ending with `data: [DONE]`, in a response that always closes
its generator, so a request whose client went away is aborted at once rather than when it is collected."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

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
