"""The serving API's request bodies, read whole before any route runs: within a byte limit and a deadline.

Without this a body is as large and as slow as the client makes it: FastAPI reads all of it before validating
anything, so a 100 MB body was read into memory before being refused, and a client trickling one held its
connection open indefinitely. Here a declared `Content-Length` over the limit is refused (413) before a byte of the
body is read; a chunked body is counted as it arrives and refused at the limit; the whole body must arrive within
`timeout_s` (408). A refusal closes the connection, since the rest of the body is left unread.

The app then gets the body in one message, and any later `receive()` goes to the server, so a route still learns
that its client disconnected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidal.worker.server.connections import RenderError


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class BoundedBody:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        render_error: RenderError,
        on_refused: Callable[[Scope], None],
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.render_error = render_error
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, 413, "request_too_large", self._too_large(f" ({declared} bytes)"))
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except _TooLarge:
            await self._refuse(scope, receive, send, 413, "request_too_large", self._too_large(""))
            return
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g}s"
            await self._refuse(scope, receive, send, 408, "request_timeout", message)
            return
        except _Disconnected:
            return  # nobody is left to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                raise _TooLarge
            if not message.get("more_body", False):
                return bytes(body)

    def _too_large(self, size: str) -> str:
        return f"the request body{size} is larger than the limit of {self.max_bytes} bytes (max_request_body_bytes)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, code: str, message: str) -> None:
        self.on_refused(scope)
        response = self.render_error(status, code, message)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
