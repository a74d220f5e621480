"""The Service load harness against two small local HTTP servers: the openai client's retries move a request off a
dead endpoint onto the other, and the report tells a victim's failures from a survivor's."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.devcluster.service_endpoints import BalancingTransport, Endpoint
from tidal.devcluster.service_load import ServiceLoad

TEXT = " and out"


class _Completions(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.answer == "cut":  # type: ignore[attr-defined]
            self.connection.shutdown(socket.SHUT_RDWR)  # what a client of a killed process sees
            return
        text = self.server.answer  # type: ignore[attr-defined]
        payload = {
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        }  # fmt: skip
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


class _FixedEndpoints:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints

    def ready(self) -> list[Endpoint]:
        return list(self.endpoints)


@pytest.fixture
def servers():
    started = []
    for answer in (TEXT, TEXT):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
        server.answer = answer  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _load(servers, streams: int = 4) -> tuple[ServiceLoad, _FixedEndpoints]:
    endpoints = _FixedEndpoints([Endpoint(f"pod-{i}", "127.0.0.1", s.server_address[1]) for i, s in enumerate(servers)])
    transport = BalancingTransport(endpoints)  # type: ignore[arg-type]
    load = ServiceLoad(transport, "m", "p", 4, TEXT, streams=streams, timeout_s=5, max_retries=3)
    return load, endpoints


def test_requests_spread_over_the_endpoints_and_match_the_reference(servers):
    load, _ = _load(servers)
    load.start().wait_for_requests(20, timeout_s=30)
    report = load.stop()
    assert report.survivor_losses == [] and report.failed_attempts == {}
    assert {a.pod for r in report.records for a in r.attempts} == {"pod-0", "pod-1"}


def test_a_victims_cut_connections_are_retried_onto_the_survivor_and_counted(servers):
    load, _ = _load(servers)
    servers[0].answer = "cut"
    load.start().wait_for_requests(20, timeout_s=60)
    report = load.stop(victims={"pod-0"})
    assert report.survivor_losses == []
    assert report.failed_attempts["pod-0"] > 0 and "pod-1" not in report.failed_attempts
    assert len(report.retried_ok) > 0
    assert all(r.text == TEXT for r in report.completed)


def test_a_survivors_failure_or_a_wrong_text_is_a_loss(servers):
    load, _ = _load(servers)
    servers[0].answer = "cut"
    servers[1].answer = " something else"
    load.start().wait_for_requests(8, timeout_s=60)
    report = load.stop(victims=set())  # pod-0 was not failed on purpose: its cuts are losses
    assert report.survivor_losses
    assert report.wrong_text
