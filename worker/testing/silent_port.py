"""A port that accepts TCP connections and never answers: a frozen trainer's rendezvous, as a client sees it."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType


class SilentPort:
    """Listens on 127.0.0.1 (`port`), accepts every connection and reads nothing until `close()`."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)  # accept() polls, so that close() ends the thread without a wake-up trick
        self.port: int = self._server.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-port", daemon=True)
        self._thread.start()

    def __enter__(self) -> SilentPort:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            self.accepted.append(conn)

    def hung_up_by_clients(self, timeout_s: float) -> bool:
        """Whether every connection accepted so far was closed by its client within `timeout_s` (what it sent is
        drained and ignored)."""
        deadline = time.monotonic() + timeout_s
        for conn in self.accepted:
            while True:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    if not conn.recv(4096):
                        break
                except TimeoutError:
                    return False
        return True

    def close(self) -> None:
        """Stop listening and close every accepted connection: a client blocked reading from one gets EOF."""
        self._closed.set()
        self._thread.join()
        self._server.close()
        for conn in self.accepted:
            conn.close()
