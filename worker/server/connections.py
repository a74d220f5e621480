"""Connection-level limits of a listener: a deadline for each request's headers and a cap on open connections.

uvicorn bounds neither. A connection that sends nothing, or its headers a byte at a time, is held for as long as the
client likes (its keep-alive timer runs only between two requests and stops at the first byte of the next), and
`limit_concurrency` counts running requests together with connections, so long streams would refuse new clients.
Each listener therefore serves its connections with uvicorn's h11 protocol plus two rules:

- While a connection waits for a request's headers (opened, or its previous response done), a timer runs; when it
  fires, a connection holding part of a request is answered 408 and closed, an idle one is just closed (a 408 there
  could cross a request the client is sending at that moment and be taken for its answer).
- A connection opened while `max_connections` are open has its request answered 503 with Retry-After, then closed.
  It is answered after its request arrives, not at once: a reply before the request would race the client's own
  send, and the client could see a reset instead of the reason.

Error bodies come from the listener (`RenderError`), so each API keeps its own error shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from starlette.responses import Response
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger(__name__)

# (status, code, message) -> the listener's error response.
RenderError = Callable[[int, str, str], Response]


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_read_timeout_s: float
    retry_after_s: int


@dataclass(frozen=True)
class _Policy:
    limits: ConnectionLimits
    render_error: RenderError


class _LimitedH11Protocol(H11Protocol):
    policy: ClassVar[_Policy]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.policy.limits.max_connections:
            log.warning("refusing a connection: %d already open (max_connections)", len(self.connections) - 1)
            self.app = self._refusal(503, "too_many_connections", "this worker has too many open connections")
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def _watch_headers(self) -> None:
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting:
            self._stop_header_timer()
        elif self._header_timer is None:
            timeout = self.policy.limits.header_read_timeout_s
            self._header_timer = self.loop.call_later(timeout, self._on_header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial_request, _ = self.conn.trailing_data
        if partial_request:
            timeout = self.policy.limits.header_read_timeout_s
            message = f"the request's headers did not arrive within {timeout:g}s"
            self._answer_and_close(self.policy.render_error(408, "request_timeout", message))
        else:
            self.transport.close()

    def _answer_and_close(self, response: Response) -> None:
        headers = [*response.raw_headers, (b"connection", b"close")]
        try:
            for event in (
                h11.Response(
                    status_code=response.status_code, headers=headers, reason=STATUS_PHRASES[response.status_code]
                ),
                h11.Data(data=bytes(response.body)),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # h11 cannot answer in this state; closing still ends the wait
        self.transport.close()

    def _refusal(self, status: int, code: str, message: str) -> Response:
        response = self.policy.render_error(status, code, message)
        response.headers["Retry-After"] = str(self.policy.limits.retry_after_s)
        response.headers["Connection"] = "close"
        return response


def limited_protocol(limits: ConnectionLimits, render_error: RenderError) -> type[H11Protocol]:
    """The protocol class a listener's uvicorn server builds its connections with."""
    return type("LimitedH11Protocol", (_LimitedH11Protocol,), {"policy": _Policy(limits, render_error)})
