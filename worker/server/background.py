"""Run a worker's servers on a background thread: for tests and benchmarks that drive a real server in-process."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import Listener, WorkerServers, build_api_app
from tidal.worker.server.runtime import WorkerRuntime

if TYPE_CHECKING:
    from tidal.worker.engine.async_engine import AsyncEngine


class BackgroundServers:
    def __init__(self, servers: WorkerServers) -> None:
        self.servers = servers
        self.exit_code: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-worker-servers", daemon=True)

    def start(self) -> None:
        """Bind every listener (so the ports are known on return), then serve on the thread."""
        self.servers.bind()
        self.servers.attach_loop(self._loop)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop serving and shut the engine down; returns the servers' exit code (None if they did not stop)."""
        self.servers.request_stop()
        self._thread.join(timeout_s)
        return self.exit_code

    def _run(self) -> None:
        try:
            self.exit_code = self._loop.run_until_complete(self.servers.run())
        finally:
            self._loop.close()


class LocalWorker:
    """A whole serving stack (runtime, metrics, API on 127.0.0.1:any port) on a background thread."""

    def __init__(self, load_engine: Callable[[], AsyncEngine], stream_write_timeout_s: float = 30.0) -> None:
        self.runtime = WorkerRuntime(load_engine)
        self.metrics = WorkerMetrics(CollectorRegistry(), self.runtime.stats)
        app = build_api_app(self.runtime, self.metrics, stream_write_timeout_s)
        self.listener = Listener("serving", app, "127.0.0.1", 0)
        self.background = BackgroundServers(WorkerServers(self.runtime, [self.listener], log_level="warning"))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listener.bound_port}"

    def start(self) -> LocalWorker:
        self.background.start()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> LocalWorker:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.background.exit_code is not None:
                raise RuntimeError(f"the worker exited with code {self.background.exit_code} while loading")
            try:
                with urllib.request.urlopen(f"{self.base_url}/ready", timeout=5) as response:
                    if response.status == 200:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    raise
            except urllib.error.URLError:
                pass  # not accepting yet
            time.sleep(0.05)
        raise TimeoutError(f"the worker was not ready within {timeout_s:g}s")

    def stop(self) -> int | None:
        return self.background.stop()
