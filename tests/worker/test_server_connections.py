"""The listeners' connections on loopback, without a model: latency of small writes, header and body deadlines, the
connection cap and the body size limit.

The servers are the production ones (`Listener`, `WorkerServers`, the serving app), with a runtime whose model never
finishes loading: every limit here acts before a route needs the engine. Timing bounds are far from both sides:
Nagle's algorithm against a delayed ACK costs ~40 ms a write, a fixed server well under 1 ms; a deadline of 0.5 s is
checked against a wait of 10 s.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route

from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import Listener, WorkerServers, build_api_app, connection_limits
from tidal.worker.server.background import BackgroundServers
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.errors import connection_error_response
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.runtime import WorkerRuntime
from tidal.worker.server.streaming import SSEResponse

WAIT_S = 10.0  # how long a test waits for what a fixed server does within a second
SSE_EVENTS = 40
SSE_INTERVAL_S = 0.005


async def _timestamped_events(_request):
    async def events():
        for _ in range(SSE_EVENTS):
            await asyncio.sleep(SSE_INTERVAL_S)
            yield f"data: {time.perf_counter()}\n\n"

    return SSEResponse(events(), on_close=lambda: None, write_timeout_s=5.0)


class ModelLessServer:
    """The serving listener (and one that streams timestamped SSE events) around a model that never loads."""

    def __init__(self, config: ServerConfig) -> None:
        self._gate = threading.Event()
        runtime = WorkerRuntime(self._never_loads)
        metrics = WorkerMetrics(CollectorRegistry(), runtime.stats)
        limits = connection_limits(config)
        api = build_api_app(runtime, metrics, config, PromptBuilder(1))
        sse = Starlette(routes=[Route("/events", _timestamped_events)])
        listeners = [
            Listener("serving", api, "127.0.0.1", 0, limits, connection_error_response),
            Listener("sse", sse, "127.0.0.1", 0, limits, connection_error_response),
        ]
        self.background = BackgroundServers(WorkerServers(runtime, listeners, log_level="warning")).start()
        self.port = self.background.servers.listener("serving").bound_port
        self.url = self.background.url()

    def _never_loads(self):
        self._gate.wait()
        raise RuntimeError("the test is over")

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)
        sock.settimeout(WAIT_S)
        return sock

    def stop(self) -> None:
        self.background.stop()
        self._gate.set()


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(
        host="127.0.0.1", port=0, header_read_timeout_s=0.5, body_read_timeout_s=0.5, max_request_body_bytes=1024
    )
    running = ModelLessServer(config)
    yield running
    running.stop()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response, read until the server closes the connection (every refusal here closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return int(status_line.split()[1]), headers, body


def test_kept_alive_round_trips_are_not_held_by_nagle(server):
    with httpx.Client(timeout=WAIT_S) as client:
        for _ in range(5):  # warm up: the connection, the server's first request
            assert client.get(f"{server.url}/health").status_code == 200
        times = []
        for _ in range(20):
            start = time.perf_counter()
            assert client.get(f"{server.url}/health").status_code == 200
            times.append(time.perf_counter() - start)
    # Held by Nagle's algorithm the response's body waited for the client's delayed ACK: a median of ~44 ms.
    assert statistics.median(times) < 0.02, [round(t * 1000, 1) for t in times]


def test_sse_events_leave_as_they_are_written(server):
    url = f"{server.background.url('sse')}/events"
    first_latencies: list[float] = []
    with httpx.Client(timeout=WAIT_S) as client:
        for stream in range(3):
            latencies: list[float] = []
            with client.stream("GET", url) as response:
                for chunk in response.iter_raw():
                    arrived = time.perf_counter()
                    for event in chunk.decode().split("\n\n"):
                        if event.startswith("data: "):
                            latencies.append(arrived - float(event.removeprefix("data: ")))
            assert len(latencies) == SSE_EVENTS
            if stream > 0:  # on the kept-alive connection, where the client's ACK of the headers is delayed
                first_latencies.append(statistics.median(latencies[:5]))
    # Held by Nagle's algorithm behind the headers, the first ~8 events (5 ms apart) left together when the delayed
    # ACK came back, ~40 ms after the first: the median latency of the first five was ~27 ms, against ~0.2 ms.
    assert max(first_latencies) < 0.01, [round(t * 1000, 1) for t in first_latencies]


def test_headers_that_never_finish_get_a_408_and_the_connection_closed(server):
    with server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        start = time.monotonic()
        status, headers, body = _read_response(sock)
    assert status == 408
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < WAIT_S / 2


def test_a_connection_that_sends_nothing_is_closed(server):
    with server.connect() as sock:
        assert sock.recv(1024) == b""  # closed by the server, without an answer to a request it never got


def test_a_request_sent_at_once_is_served_normally(server):
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, body = _read_response(sock)
    assert status == 200
    assert json.loads(body)["status"] == "ok"


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    with server.connect() as sock:
        # 100 MB announced, none of it sent: the answer comes without waiting for it.
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large"
    assert "100000000 bytes" in error["message"] and "max_request_body_bytes" in error["message"]


def test_a_chunked_body_is_refused_at_the_limit(server):
    payload = b'{"model": "m", "prompt": "' + b"x" * 4096 + b'"}'
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:2000], payload[2000:])) + b"0\r\n\r\n"
    with server.connect() as sock:
        # In one write, so that the server has read all of it when it answers and closes (unread bytes would make
        # the close a reset, which can overtake the answer).
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks
        )
        status, _, body = _read_response(sock)
    assert status == 413
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large"
    assert "larger than the limit of 1024 bytes" in error["message"]


def test_a_body_within_the_limit_reaches_the_route(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=WAIT_S)
    assert response.status_code == 503  # validated, routed, and told the model is still loading
    assert response.json()["error"]["code"] == "not_ready"


def test_a_body_that_stops_arriving_gets_a_408(server):
    with server.connect() as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        start = time.monotonic()
        status, _, body = _read_response(sock)
    assert status == 408
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < WAIT_S / 2


def test_connections_beyond_the_limit_are_answered_503_and_closed():
    config = ServerConfig(host="127.0.0.1", port=0, max_connections=2, overload_retry_after_s=3)
    running = ModelLessServer(config)
    try:
        first, second = running.connect(), running.connect()
        with running.connect() as third:
            third.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = _read_response(third)
        assert status == 503
        assert headers["retry-after"] == "3"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        # The two held connections are served as usual.
        first.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_response(first)[0] == 200
        first.close()
        # Once the server has seen one of them go, a new connection is served again.
        deadline = time.monotonic() + WAIT_S
        while (status := httpx.get(f"{running.url}/health", timeout=WAIT_S).status_code) != 200:
            assert time.monotonic() < deadline, f"still {status} after a connection closed"
            time.sleep(0.05)
        second.close()
    finally:
        running.stop()
