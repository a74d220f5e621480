"""The control API app: state, sleep/wake, weight updates (disk, streamed, collective), checksums, group membership.

Every route requires the bearer token (401 and no effect otherwise); bodies and answers are the models of
`tidal.contract.control_api`, and every failure is a `ControlError` whose code is an `ErrorCode` of
`tidal.contract.error_codes`, answered with the status `HTTP_STATUS` gives it. Served on its own port
(TIDAL_CONTROL_PORT), beside the OpenAI API, from the same process and event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tidal.contract.control_api import (
    CollectiveUpdateRequest,
    ControlError,
    GroupReconfigureRequest,
    GroupReconfigureResult,
    SleepRequest,
    StreamChunkResult,
    StreamFinishRequest,
    StreamStartRequest,
    StreamStartResponse,
    TransitionResult,
    WakeUpRequest,
    WeightsChecksum,
    WeightsUpdateRequest,
    WeightsUpdateResult,
    WorkerState,
)
from tidal.contract.error_codes import ErrorCode
from tidal.worker.control.auth import is_authorized
from tidal.worker.lifecycle.errors import BadRequestError, LifecycleError
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.lifecycle.uploads import FILE_NAME_PATTERN
from tidal.worker.server.errors import describe_validation_errors
from tidal.worker.server.openapi_doc import conform_openapi

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 30
# A chunk's body must keep arriving: a client gone without closing its connection would otherwise hold its file's
# claim (and what arrived of its body) for as long as the connection lasts, and each resend would be refused as busy.
CHUNK_IDLE_TIMEOUT_S = 60.0

# The one place a code becomes an HTTP status; a test fails when a member of ErrorCode has none.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.UNKNOWN_UPLOAD: 404,
    ErrorCode.BAD_OFFSET: 409,
    ErrorCode.BUSY: 409,
    ErrorCode.DRAIN_TIMEOUT: 409,
    ErrorCode.WEIGHTS_UNAVAILABLE: 409,
    ErrorCode.NO_HOST_MEMORY: 409,
    ErrorCode.STALE_EPOCH: 409,
    ErrorCode.GROUP_UNREACHABLE: 503,
    ErrorCode.EXPERTS_UNAVAILABLE: 409,
    ErrorCode.BAD_CHECKPOINT: 422,
    ErrorCode.INTERNAL: 500,
    ErrorCode.COLLECTIVE_FAILED: 502,
    ErrorCode.NOT_LOADED: 503,
}

# Query parameters a client might put a token in.
_TOKEN_PARAMS = frozenset({"token", "access_token", "control_token"})

# Refusals starlette makes itself, before a route runs.
_ROUTING_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


def _error(
    code: ErrorCode, message: str, headers: Mapping[str, str] | None = None, status: int | None = None
) -> JSONResponse:
    """`status`: only for a refusal whose status the HTTP layer chose (see on_http_error); else the code's own."""
    body = ControlError(code=code, message=message).model_dump(mode="json")
    return JSONResponse(body, status_code=HTTP_STATUS[code] if status is None else status, headers=headers)


def connection_error_response(status: int, _code: str, message: str) -> JSONResponse:
    """The control API's answer to a request its listener's limits refuse (`server.connections.RenderError`): the
    status the limit chose, under `busy` when it says "come back later", else `invalid_request`."""
    return _error(ErrorCode.BUSY if status == 503 else ErrorCode.INVALID_REQUEST, message, status=status)


class _RequireToken:
    """Checks the token before routing and before the body is read, so a caller without it learns nothing (not
    whether a route exists, nor how its body is parsed): every answer to it is the same 401."""

    def __init__(self, app: ASGIApp, token: SecretStr) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _has_token_param(scope):
            # The access log writes the path with its query: blank it (the log reads this scope) and refuse, so a
            # token sent in the URL is neither logged nor taken.
            scope["query_string"] = b""
            message = "send the token in the Authorization header (Bearer), never in the URL"
            await _error(ErrorCode.INVALID_REQUEST, message)(scope, receive, send)
            return
        if scope["type"] == "http":
            header = Headers(scope=scope).get("authorization")
            if not is_authorized(header, self.token):
                headers = {"WWW-Authenticate": "Bearer"}
                response = _error(ErrorCode.UNAUTHORIZED, "missing or wrong bearer token", headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _has_token_param(scope: Scope) -> bool:
    query = scope.get("query_string", b"").decode("latin-1")
    return any(name.lower() in _TOKEN_PARAMS for name, _ in parse_qsl(query, keep_blank_values=True))


def build_control_app(manager: LifecycleManager, token: SecretStr) -> FastAPI:
    app = FastAPI(title="Tidal worker control API")
    app.add_middleware(_RequireToken, token=token)
    _install_error_handlers(app)
    app.include_router(_router(manager))
    conform_openapi(app, ControlError.__name__, bearer=True)
    return app


_BAD, _BUSY, _NOT_LOADED = ErrorCode.INVALID_REQUEST, ErrorCode.BUSY, ErrorCode.NOT_LOADED
# What can refuse a call that swaps weights in: the swap, the drain before it, the checkpoint itself.
_SWAP = (ErrorCode.BUSY, ErrorCode.DRAIN_TIMEOUT, ErrorCode.WEIGHTS_UNAVAILABLE, ErrorCode.BAD_CHECKPOINT)
# A chunk's body is the file's raw bytes, read as a stream (see stream_chunk), so FastAPI cannot document it itself.
_RAW_BYTES: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def _refusals(*codes: ErrorCode) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a route's refusals, by status, naming their codes; every route may answer 401."""
    by_status: dict[int, list[str]] = {}
    for code in (ErrorCode.UNAUTHORIZED, *codes):
        names = by_status.setdefault(HTTP_STATUS[code], [])
        if code.value not in names:
            names.append(code.value)
    return {
        status: {"model": ControlError, "description": f"`code`: {', '.join(names)}"}
        for status, names in sorted(by_status.items())
    }


def _router(manager: LifecycleManager) -> APIRouter:
    router = APIRouter()

    @router.get("/state", responses=_refusals())
    async def state() -> WorkerState:
        return manager.state()

    @router.post("/sleep", responses=_refusals(_BAD, _BUSY, ErrorCode.DRAIN_TIMEOUT, _NOT_LOADED))
    async def sleep(body: SleepRequest) -> TransitionResult:
        return await manager.sleep(body)

    @router.post(
        "/wake_up",
        responses=_refusals(_BAD, _BUSY, ErrorCode.NO_HOST_MEMORY, ErrorCode.WEIGHTS_UNAVAILABLE, _NOT_LOADED),
    )
    async def wake_up(body: WakeUpRequest | None = None) -> TransitionResult:
        return await manager.wake_up(body or WakeUpRequest())

    @router.post("/weights/update", responses=_refusals(_BAD, *_SWAP, _NOT_LOADED))
    async def update(body: WeightsUpdateRequest) -> WeightsUpdateResult:
        return await manager.update_from_disk(body)

    @router.post("/weights/stream/start", responses=_refusals(_BAD, _BUSY, _NOT_LOADED))
    async def stream_start(body: StreamStartRequest | None = None) -> StreamStartResponse:
        upload = await manager.stream_start((body or StreamStartRequest()).allow_extra_tensors)
        return StreamStartResponse(upload_id=upload.upload_id)

    @router.post(
        "/weights/stream/{upload_id}/chunk",
        responses={
            **_refusals(_BAD, ErrorCode.UNKNOWN_UPLOAD, ErrorCode.BAD_OFFSET, _BUSY, _NOT_LOADED),
            408: {"model": ControlError, "description": "`code`: invalid_request (the body stopped arriving)"},
        },
        openapi_extra=_RAW_BYTES,
    )
    async def stream_chunk(
        upload_id: str,
        request: Request,
        file: Annotated[str, Query(pattern=FILE_NAME_PATTERN)],
        offset: Annotated[int, Query(ge=0)],
    ) -> StreamChunkResult:
        # Checked before a byte of the body is read: a chunk the upload cannot take is answered at once (the server
        # drops the rest of its body as it arrives, and a client that sent `Expect: 100-continue` sends none).
        async with manager.stream_chunk_arriving(upload_id, file, offset) as claim:
            data = await _read_chunk(request)
            upload = await manager.stream_chunk(upload_id, file, offset, data, claim)
        return StreamChunkResult(upload_id=upload_id, file=file, received_bytes=upload.received[file])

    @router.post(
        "/weights/stream/{upload_id}/finish", responses=_refusals(_BAD, ErrorCode.UNKNOWN_UPLOAD, *_SWAP, _NOT_LOADED)
    )
    async def stream_finish(upload_id: str, body: StreamFinishRequest) -> WeightsUpdateResult:
        return await manager.stream_finish(upload_id, body)

    @router.delete("/weights/stream/{upload_id}", status_code=204, responses=_refusals(ErrorCode.UNKNOWN_UPLOAD, _BUSY))
    async def stream_discard(upload_id: str) -> None:
        await manager.stream_discard(upload_id)

    @router.post("/weights/collective", responses=_refusals(_BAD, *_SWAP, ErrorCode.COLLECTIVE_FAILED, _NOT_LOADED))
    async def collective(body: CollectiveUpdateRequest) -> WeightsUpdateResult:
        return await manager.update_collective(body)

    @router.get("/weights/checksum", responses=_refusals(_BAD, _BUSY, _NOT_LOADED))
    async def checksum(recompute: bool = False) -> WeightsChecksum:
        """Cached per version unless `recompute` (hashing a large model takes a second or more)."""
        return await manager.checksum(recompute)

    @router.post(
        "/group/reconfigure",
        responses=_refusals(
            _BAD,
            ErrorCode.STALE_EPOCH,
            _BUSY,
            ErrorCode.EXPERTS_UNAVAILABLE,
            ErrorCode.GROUP_UNREACHABLE,
            ErrorCode.COLLECTIVE_FAILED,
            _NOT_LOADED,
        ),
    )
    async def group_reconfigure(body: GroupReconfigureRequest) -> GroupReconfigureResult:
        """The group's membership for an epoch: newer than the last applied (409 stale_epoch otherwise; the same
        epoch and membership again is a 200 with applied=false), with this worker's rank among the members (400)."""
        return await manager.reconfigure(body)

    return router


async def _read_chunk(request: Request) -> bytearray:
    """A chunk's whole body: refused at MAX_CHUNK_BYTES, not after holding all of it, and with 408 once no byte of
    it arrived for CHUNK_IDLE_TIMEOUT_S."""
    data = bytearray()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(CHUNK_IDLE_TIMEOUT_S) as deadline:
            async for piece in request.stream():
                deadline.reschedule(loop.time() + CHUNK_IDLE_TIMEOUT_S)
                data += piece
                if len(data) > MAX_CHUNK_BYTES:
                    raise BadRequestError(f"a chunk may hold at most {MAX_CHUNK_BYTES} bytes")
    except TimeoutError:
        message = f"no byte of the chunk arrived for {CHUNK_IDLE_TIMEOUT_S:g}s; nothing was written"
        raise HTTPException(408, message) from None
    return data


def _install_error_handlers(app: FastAPI) -> None:
    async def on_lifecycle_error(_: Request, exc: LifecycleError) -> JSONResponse:
        return _error(exc.code, exc.message)

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message = describe_validation_errors(exc.errors())[0]
        return _error(ErrorCode.INVALID_REQUEST, message)

    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Routing refuses with 404 or 405. Any other HTTPException is a request starlette could not take: it keeps
        # the status starlette chose (e.g. 413), under the code of its class.
        routing = _ROUTING_CODES.get(exc.status_code)
        if routing is not None:
            return _error(routing, str(exc.detail), exc.headers)
        fallback = ErrorCode.INVALID_REQUEST if exc.status_code < 500 else ErrorCode.INTERNAL
        return _error(fallback, str(exc.detail), exc.headers, status=exc.status_code)

    async def on_disconnect(request: Request, _: ClientDisconnect) -> JSONResponse:
        # The client went away while its body arrived (a trainer restarting mid-chunk): the route did nothing (a
        # chunk is written only once all of it arrived), and nobody is left to read an answer. Handled here, not by
        # on_unexpected, which would log it as a failure with its traceback and re-raise it to the server.
        log.info("control call %s %s: the client disconnected before its body arrived; nothing was done",
                 request.method, request.url.path)  # fmt: skip
        return _error(ErrorCode.INVALID_REQUEST, "the client disconnected before the whole body arrived")

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("control call %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    app.add_exception_handler(LifecycleError, on_lifecycle_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, on_disconnect)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
