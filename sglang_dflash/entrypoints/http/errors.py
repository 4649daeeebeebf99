"""OpenAI-style error bodies `{"error": {"message", "type", "code"}}`, RequestError (a request that fails
with a status of its own: busy, shutting down, failed in its batch, past its deadline) and the app's exception
handlers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError",
}


class RequestError(Exception):
    """A request ended with this HTTP status (non-streaming) or error event (streaming)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc))

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(_: Request, exc: ClientDisconnect) -> JSONResponse:
        return error_response(400, "client disconnected")

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("error while serving %s", request.url.path)
        return error_response(500, f"internal error: {exc}")
