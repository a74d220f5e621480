"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a caller can cause is a 4xx with a readable reason; FastAPI's default 422 for a bad body is turned
into OpenAI's 400 here, with pydantic's messages joined into one line per problem.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from tidal.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# OpenAI's error "type" for each status this server returns.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ApiError(Exception):
    """Raised by handlers for a failure the caller should see as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorResponse:
    """The error as OpenAI shapes it, the same whether it is a response or a streamed event."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(status, message, param=param, code=code)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def connection_error_response(status: int, code: str, message: str) -> JSONResponse:
    """The serving API's answer to a request its listener or body limits refuse (`connections.RenderError`)."""
    return error_response(status, message, code=code)


# Tags pydantic puts in an error's location for union members and validators; they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc: Sequence[Any]) -> str:
    """`("body", "messages", 0, "role")` -> `messages.0.role`; union-member tags such as `list[int]` are dropped."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts)


def describe_validation_errors(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message for all of pydantic's errors, and the first offending field (OpenAI's `param`)."""
    lines: list[str] = []
    first_param: str | None = None
    for err in errors:
        if err.get("type") == "json_invalid":
            lines.append(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        path = _field_path(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        line = f"{path}: {msg}" if path else msg
        if line not in lines:
            lines.append(line)
        if first_param is None and path:
            first_param = path
    return "; ".join(lines) or "invalid request", first_param


# Metric label of each generation endpoint, for counting the requests refused before they reach a handler.
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


def count_refusal(metrics: WorkerMetrics, path: str) -> None:
    """Count a generation request refused before its handler ran (other paths are not counted)."""
    if path in _ENDPOINTS:
        metrics.record_finished(_ENDPOINTS[path], "rejected")


def install_error_handlers(app: FastAPI, metrics: WorkerMetrics) -> None:
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_refusal(metrics, request.url.path)
        message, param = describe_validation_errors(exc.errors())
        return error_response(400, message, param=param)

    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's headers carry what the status needs, e.g. a 405's `Allow` (RFC 9110 requires it).
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, detail, headers=dict(exc.headers) if exc.headers else None)

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}")

    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected_error)
