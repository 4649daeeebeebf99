"""`--api-key`: every endpoint but /health needs `Authorization: Bearer <key>` (a 401 otherwise)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from sglang_dflash.entrypoints.http.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Plain ASGI middleware (no BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "Invalid or missing API key")(scope, receive, send)
                return
        await self.app(scope, receive, send)
