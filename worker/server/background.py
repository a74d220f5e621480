"""Run a worker's servers on a background thread: for tests and benchmarks that drive a real server in-process.

The servers come assembled (`tidal.worker.process.assemble_worker`); this only gives them a thread and an event
loop, and waits for them to be ready the way a client would, through `/ready`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

from tidal.worker.server.app import WorkerServers


class BackgroundServers:
    def __init__(self, servers: WorkerServers) -> None:
        self.servers = servers
        self.exit_code: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-worker-servers", daemon=True)

    def url(self, listener: str = "serving") -> str:
        return f"http://127.0.0.1:{self.servers.listener(listener).bound_port}"

    def start(self) -> BackgroundServers:
        """Bind every listener (so the ports are known on return), then serve on the thread."""
        self.servers.bind()
        self.servers.attach_loop(self._loop)
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> BackgroundServers:
        """Return once the serving API says ready; RuntimeError if the servers exit first (a failed load)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exit_code is not None:
                raise RuntimeError(f"the worker exited with code {self.exit_code} while loading")
            try:
                with urllib.request.urlopen(f"{self.url()}/ready", timeout=5) as response:
                    if response.status == 200:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    raise
            except urllib.error.URLError:
                pass  # not accepting yet
            time.sleep(0.05)
        raise TimeoutError(f"the worker was not ready within {timeout_s:g}s")

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
