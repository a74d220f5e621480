"""Async client of one worker's control API, built on the shared contract in tidal.contract.control_api.

Every answer is parsed with the schema's models, so a drift between the worker and the operator is an error here,
not a silently missing field. A non-2xx answer becomes a `WorkerCallError` carrying the worker's `ControlError`,
or, when there was no answer the client can read, one of the client's own `CallErrorCode`s.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

import httpx
from pydantic import BaseModel, SecretStr, ValidationError

from tidal.contract.control_api import (
    TOKEN_HEADER,
    ControlError,
    GroupReconfigureRequest,
    GroupReconfigureResult,
    SleepLevel,
    SleepRequest,
    TransitionResult,
    WakeUpRequest,
    WeightsChecksum,
    WeightsUpdateRequest,
    WeightsUpdateResult,
    WorkerState,
)
from tidal.contract.error_codes import ErrorCode

_T = TypeVar("_T", bound=BaseModel)

# Reading state must be quick: a pass waits for every rank, and a frozen worker must not stall the others.
STATE_TIMEOUT_S = 3.0
# Sleep, wake and weight updates move whole checkpoints; the worker bounds its own drain time.
TRANSITION_TIMEOUT_S = 600.0
# A reconfigure is bounded by the request's own timeout_s on the worker; the answer may take a little longer.
RECONFIGURE_SLACK_S = 10.0


class CallErrorCode(StrEnum):
    """Codes this client gives a call that got no answer it can read. Kept apart from the contract's `ErrorCode`
    because no worker ever sends them: the worker's table of statuses covers exactly what it answers, and a reader of
    a failure can tell the worker's refusal from the road to it failing."""

    UNREACHABLE = "unreachable"  # no HTTP answer: connection refused or reset, timeout, DNS
    BAD_RESPONSE = "bad_response"  # a 2xx answer whose body does not fit the contract's model
    UNRECOGNIZED_ERROR = "unrecognized_error"  # an error answer that is no ControlError (a newer code, or a proxy)


class WorkerCallError(Exception):
    """The worker refused the call (an `ErrorCode`), or the call got no answer the client can read."""

    def __init__(self, code: ErrorCode | CallErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class WorkerClient:
    """One rank's control API at `http://address:port`. Share one `httpx.AsyncClient` between ranks."""

    def __init__(self, http: httpx.AsyncClient, address: str, port: int, token: SecretStr) -> None:
        self._http = http
        self._base = f"http://{address}:{port}"
        self._token = token

    def _headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: f"Bearer {self._token.get_secret_value()}"}

    async def _call(
        self, method: str, path: str, out: type[_T], body: BaseModel | None = None, timeout: float = STATE_TIMEOUT_S
    ) -> _T:
        payload = body.model_dump(mode="json") if body is not None else None
        try:
            resp = await self._http.request(
                method, self._base + path, json=payload, headers=self._headers(), timeout=timeout
            )
        except httpx.HTTPError as exc:
            message = f"{method} {path}: {type(exc).__name__}: {exc}"
            raise WorkerCallError(CallErrorCode.UNREACHABLE, message) from None
        if resp.status_code >= 400:
            try:
                err = ControlError.model_validate_json(resp.content)
            except ValidationError:
                message = f"{method} {path}: HTTP {resp.status_code}: {resp.text[:2000]}"
                raise WorkerCallError(CallErrorCode.UNRECOGNIZED_ERROR, message) from None
            raise WorkerCallError(err.code, err.message)
        try:
            return out.model_validate_json(resp.content)
        except ValidationError as exc:
            raise WorkerCallError(CallErrorCode.BAD_RESPONSE, f"{method} {path}: {exc}") from None

    async def state(self, timeout: float = STATE_TIMEOUT_S) -> WorkerState:
        return await self._call("GET", "/state", WorkerState, timeout=timeout)

    async def checksum(self) -> WeightsChecksum:
        return await self._call("GET", "/weights/checksum", WeightsChecksum, timeout=60.0)

    async def sleep(self, level: SleepLevel) -> TransitionResult:
        return await self._call(
            "POST", "/sleep", TransitionResult, SleepRequest(level=level), timeout=TRANSITION_TIMEOUT_S
        )

    async def wake_up(self) -> TransitionResult:
        return await self._call("POST", "/wake_up", TransitionResult, WakeUpRequest(), timeout=TRANSITION_TIMEOUT_S)

    async def update_weights(self, source: str, version: str) -> WeightsUpdateResult:
        request = WeightsUpdateRequest(source=source, version=version)
        return await self._call("POST", "/weights/update", WeightsUpdateResult, request, timeout=TRANSITION_TIMEOUT_S)

    async def reconfigure(self, request: GroupReconfigureRequest) -> GroupReconfigureResult:
        return await self._call(
            "POST", "/group/reconfigure", GroupReconfigureResult, request,
            timeout=request.timeout_s + RECONFIGURE_SLACK_S,
        )  # fmt: skip
