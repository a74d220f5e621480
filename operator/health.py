"""`GET /healthz` for the Deployment's probes: alive while the operator's loops keep beating.

A standby replica (waiting for the leader Lease) is healthy too; the answer says which role the process has. A loop
that stopped beating for `stale_after_s` (a hung event loop, a stuck lease thread) makes the probe fail, so the
kubelet restarts the pod.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health:
    def __init__(self, stale_after_s: float = 90.0) -> None:
        self.stale_after_s = stale_after_s
        self.role = "starting"
        self._beat = time.monotonic()
        self._lock = threading.Lock()

    def beat(self, role: str | None = None) -> None:
        with self._lock:
            self._beat = time.monotonic()
            if role is not None:
                self.role = role

    def report(self) -> tuple[bool, dict[str, object]]:
        with self._lock:
            age = time.monotonic() - self._beat
            return age < self.stale_after_s, {"role": self.role, "seconds_since_beat": round(age, 1)}


def serve_health(health: Health, address: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            ok, body = health.report()
            data = json.dumps({"ok": ok, **body}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: not worth a line
            return

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
