"""BodyLimitMiddleware: a request body larger than the limit gets a 413 at once, from its Content-Length
header before any of it is read, or (chunked uploads) as soon as the bytes received pass the limit."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sglang_dflash.entrypoints.http.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes (--max-request-body-mb)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if int(length) > self.max_bytes:
                return await error_response(413, self.too_large(length.decode()))(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.too_large(f"more than {received}"))
            return message

        await self.app(scope, limited, send)
