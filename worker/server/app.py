"""App factories and the process's servers: one uvicorn server per listener, one event loop, one engine.

The serving API is one listener; the control API (sleep/wake, weight updates) is another on its own port, built by
its own factory; `tidal.worker.process` assembles the list `WorkerServers` runs. The supervisor owns the
signals (uvicorn's per-server handling would stop only one listener, then re-raise the signal and kill the process
before the engine is shut down), binds every socket before starting anything (a busy port is a clear error, and a
test can ask for port 0), loads the model while the probes already answer, and exits non-zero if loading fails.

Each listener's connections are bounded (`connections.py`: header deadline, connection cap) and the serving app's
request bodies too (`request_body.py`: size, deadline), with the limits of `ServerConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Scope

from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.connections import ConnectionLimits, RenderError, limited_protocol
from tidal.worker.server.errors import (
    ErrorResponse,
    connection_error_response,
    count_refusal,
    install_error_handlers,
)
from tidal.worker.server.openapi_doc import conform_openapi
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.request_body import BoundedBody
from tidal.worker.server.routes_openai import openai_router
from tidal.worker.server.routes_probes import probe_router
from tidal.worker.server.routes_tokenize import tokenize_router
from tidal.worker.server.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def build_api_app(
    runtime: WorkerRuntime, metrics: WorkerMetrics, config: ServerConfig, prompt_builder: PromptBuilder
) -> FastAPI:
    """The serving app: OpenAI routes, probes and metrics, behind the request-body limits."""
    app = FastAPI(title="Tidal worker", summary="OpenAI-compatible serving API of one Tidal worker")
    install_error_handlers(app, metrics)
    app.include_router(probe_router(runtime, metrics))
    app.include_router(openai_router(runtime, metrics, config, prompt_builder))
    app.include_router(tokenize_router(runtime, prompt_builder, config.max_prompt_tokens))
    conform_openapi(app, ErrorResponse.__name__)

    def on_refused(scope: Scope) -> None:
        count_refusal(metrics, scope["path"])

    app.add_middleware(
        BoundedBody,
        max_bytes=config.max_request_body_bytes,
        timeout_s=config.body_read_timeout_s,
        render_error=connection_error_response,
        on_refused=on_refused,
    )
    return app


def connection_limits(config: ServerConfig) -> ConnectionLimits:
    return ConnectionLimits(config.max_connections, config.header_read_timeout_s, config.overload_retry_after_s)


@dataclass
class Listener:
    """One app on one address. `port=0` picks a free port; `bound_port` tells which after `bind()`.

    `render_error` writes the app's own error body for the refusals its connections' limits make before any route
    runs."""

    name: str
    app: ASGIApp
    host: str
    port: int
    limits: ConnectionLimits
    render_error: RenderError
    sock: socket.socket | None = field(default=None, repr=False)
    _bound_port: int | None = field(default=None, repr=False)

    def bind(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not left 0: accepted sockets inherit the listener's proto, and asyncio sets TCP_NODELAY
        # only on sockets whose proto says TCP. Without it Nagle's algorithm held each small write (a response's
        # body after its headers, an SSE event) until the client's delayed ACK, ~40 ms on a kept-alive connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"{self.name} API cannot listen on {self.host}:{self.port}: {exc.strerror}") from exc
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        self._bound_port = int(sock.getsockname()[1])

    @property
    def bound_port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError(f"listener {self.name} is not bound yet")
        return self._bound_port


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # WorkerServers owns the signals for every listener; see the module docstring.
        yield


class WorkerServers:
    """Runs the listeners and the model load together until a signal, `request_stop()`, or a failed load."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        listeners: list[Listener],
        log_level: str = "info",
        on_stop: list[Callable[[], None]] | None = None,
    ) -> None:
        """`on_stop`: called once the servers and the engine have stopped (e.g. to let worker threads go)."""
        self.runtime = runtime
        self.listeners = listeners
        self._log_level = log_level.lower()
        self._on_stop = list(on_stop or [])
        self._servers: list[_UvicornServer] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Remembered so that a stop asked for before the servers exist is not lost.
        self._stopping = False
        # Why `run()` ended with an error, in a line for the process's termination message (None: it did not).
        self.failure: str | None = None

    def listener(self, name: str) -> Listener:
        found = [lst for lst in self.listeners if lst.name == name]
        if not found:
            raise LookupError(f"no {name} listener (this worker serves {[lst.name for lst in self.listeners]})")
        return found[0]

    def bind(self) -> None:
        for listener in self.listeners:
            if listener.sock is None:
                listener.bind()

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Name the loop `run()` will run on, so that `request_stop()` works even before `run()` starts."""
        self._loop = loop

    def request_stop(self) -> None:
        """Ask every listener to finish; callable from any thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_servers)

    def _stop_servers(self) -> None:
        self._stopping = True
        for server in self._servers:
            server.should_exit = True

    async def run(self) -> int:
        """Serve until stopped. Returns the process exit code: 0 after a stop, 1 if the model failed to load or a
        server failed."""
        self._loop = asyncio.get_running_loop()
        self.bind()
        for listener in self.listeners:
            config = uvicorn.Config(
                listener.app,
                http=limited_protocol(listener.limits, listener.render_error),
                log_level=self._log_level,
                lifespan="off",
                timeout_graceful_shutdown=5,
            )
            self._servers.append(_UvicornServer(config))
        if self._stopping:
            self._stop_servers()
        self._install_signal_handlers()
        serving = [
            asyncio.create_task(server.serve(sockets=[lst.sock]), name=f"serve-{lst.name}")  # type: ignore[list-item]
            for server, lst in zip(self._servers, self.listeners, strict=True)
        ]
        loading = asyncio.create_task(self.runtime.load(), name="load-model")
        exit_code = 0
        try:
            done, _ = await asyncio.wait([*serving, loading], return_when=asyncio.FIRST_COMPLETED)
            if loading in done and loading.exception() is not None:
                exit_code = 1
                self.failure = f"loading the model failed: {self.runtime.failure}"
            elif loading in done:
                await asyncio.wait(serving, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stop_servers()
            results = await asyncio.gather(*serving, return_exceptions=True)
            for listener, result in zip(self.listeners, results, strict=True):
                if isinstance(result, Exception):
                    log.error("a server failed", exc_info=result)
                    exit_code = 1
                    self.failure = self.failure or f"the {listener.name} API failed: {type(result).__name__}: {result}"
            if not loading.done():
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)
            await self.runtime.shutdown()
            for callback in self._on_stop:
                callback()
            for listener in self.listeners:
                if listener.sock is not None:
                    listener.sock.close()
        return exit_code

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Only the main thread may own signals; a server run from a test thread is stopped with request_stop().
            with contextlib.suppress(ValueError, RuntimeError):
                loop.add_signal_handler(sig, self._stop_servers)
