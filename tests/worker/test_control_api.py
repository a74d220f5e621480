"""The control API over HTTP: the bearer token guards every call, the contract's models come back, token settings."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from tidal.contract.control_api import ControlError, WorkerState
from tidal.contract.error_codes import ErrorCode
from tidal.worker.control.auth import ControlTokenError, is_authorized, resolve_control_token
from tidal.worker.testing.in_process import TEST_TOKEN, ControlledWorker


def test_calls_without_the_right_token_get_401_and_change_nothing(tiny_model):
    with ControlledWorker(model_path=tiny_model("llama"), num_kv_blocks=64) as worker:
        assert worker.control is not None
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token-wrong-token-x"},
                        {"Authorization": f"Basic {TEST_TOKEN}"}):  # fmt: skip
            for method, path, body in (("GET", "/state", None), ("POST", "/sleep", {"level": 2}),
                                       ("POST", "/weights/update", {"source": "/nowhere", "version": "x"}),
                                       ("POST", "/group/reconfigure", _membership(1, [0])),
                                       ("GET", "/weights/checksum", None)):  # fmt: skip
                response = worker.control.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert response.json()["code"] == "unauthorized"
                assert TEST_TOKEN not in response.text
        state = WorkerState.model_validate(worker.control.get("/state").json())
        assert state.sleep_state == "awake" and state.model_loaded and state.weights_version == "base"
        assert state.resident == ["weights", "kv_cache"] and state.rank == 0 and state.world_size == 1
        assert state.group_epoch == 0 and worker.complete("Hello").status_code == 200


def _membership(epoch: int, ranks: list[int], leader: int = 0) -> dict[str, object]:
    members = [{"rank": r, "address": f"rank-{r}.group:29500"} for r in ranks]
    return {"epoch": epoch, "members": members, "coordinator_rank": leader}


def test_group_reconfigure_applies_newer_epochs_only_and_serving_goes_on(tiny_model):
    with ControlledWorker(model_path=tiny_model("llama"), num_kv_blocks=64, rank=1, world_size=3) as worker:
        assert worker.control is not None
        expected = worker.text("Hello")

        def state() -> WorkerState:
            return WorkerState.model_validate(worker.control.get("/state").json())  # type: ignore[union-attr]

        assert (state().group_epoch, state().coordinator_rank, state().group_formed) == (0, 0, False)
        applied = worker.post("/group/reconfigure", _membership(1, [0, 1, 2]))
        assert applied.status_code == 200 and applied.json()["applied"] is True
        assert applied.json()["state"]["group_epoch"] == 1 and applied.json()["state"]["group_formed"] is True
        retry = worker.post("/group/reconfigure", _membership(1, [2, 1, 0]))
        assert retry.status_code == 200 and retry.json()["applied"] is False
        # Rank 0 fails: the survivors form epoch 2 under a new leader.
        assert worker.post("/group/reconfigure", _membership(2, [1, 2], leader=2)).status_code == 200
        got = state()
        assert (got.group_epoch, got.coordinator_rank, got.group_formed, got.world_size) == (2, 2, False, 3)
        for body, status, code, reason in (
            (_membership(1, [0, 1, 2]), 409, ErrorCode.STALE_EPOCH, "older than epoch 2"),
            (_membership(2, [0, 1, 2]), 409, ErrorCode.STALE_EPOCH, "already applied"),
            (_membership(3, [0, 2]), 400, "invalid_request", "rank 1, which is not among"),
            (_membership(3, [1, 4], leader=1), 400, "invalid_request", "outside this worker's group of world_size 3"),
            (_membership(3, [1, 2], leader=0), 400, "invalid_request", "coordinator_rank 0 is not one of the members"),
            (
                {**_membership(3, [1, 2], leader=1), "group_size": 2},
                400,
                "invalid_request",
                "outside a group of group_size 2",
            ),
            ({**_membership(3, [1]), "epoch": 0}, 400, "invalid_request", "epoch"),
            # Past int64: once applied, every epoch the operator can send would be stale.
            (_membership(2**70, [1, 2], leader=1), 400, "invalid_request", "less than or equal to 9223372036854775807"),
        ):
            refused = worker.post("/group/reconfigure", body)
            assert refused.status_code == status, (body, refused.text)
            assert refused.json()["code"] == code and reason in refused.json()["message"], refused.text
        assert (state().group_epoch, state().coordinator_rank) == (2, 2)
        # Membership is not a lifecycle operation on the weights: it is applied while asleep too, and serving
        # answers the same throughout.
        assert worker.post("/sleep", {"level": 1}).status_code == 200
        assert worker.post("/group/reconfigure", _membership(3, [0, 1, 2], leader=0)).status_code == 200
        assert worker.post("/wake_up").status_code == 200
        assert (state().group_epoch, state().group_formed) == (3, True) and worker.text("Hello") == expected
        assert (state().group.group_size, state().group.slots_per_rank) == (3, None)  # a dense model has no slots
        metrics = worker.api.get("/metrics").text  # type: ignore[union-attr]
        assert "tidal_group_epoch 3.0" in metrics and "tidal_group_size 3.0" in metrics
        assert 'tidal_lifecycle_operations_total{operation="reconfigure",outcome="ok"} 4.0' in metrics
        assert 'tidal_lifecycle_operations_total{operation="reconfigure",outcome="error"} 4.0' in metrics


def test_bad_requests_are_400_with_a_reason(tiny_model):
    with ControlledWorker(model_path=tiny_model("llama"), num_kv_blocks=64) as worker:
        response = worker.post("/sleep", {"level": 3})
        assert response.status_code == 400 and response.json()["code"] == "invalid_request"
        response = worker.post("/weights/update", {"source": "/x", "version": "bad version"})
        assert response.status_code == 400


def test_token_sources(tmp_path):
    assert resolve_control_token(None, None) is None
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN + "\n")
    assert resolve_control_token(None, token_file).get_secret_value() == TEST_TOKEN
    assert resolve_control_token(SecretStr(TEST_TOKEN), None).get_secret_value() == TEST_TOKEN
    with pytest.raises(ControlTokenError, match="only one"):
        resolve_control_token(SecretStr(TEST_TOKEN), token_file)
    with pytest.raises(ControlTokenError, match="shorter") as err:
        resolve_control_token(SecretStr("short"), None)
    assert "short" not in str(err.value).replace("shorter", "")
    with pytest.raises(ControlTokenError, match="cannot read"):
        resolve_control_token(None, tmp_path / "missing")
    secret = SecretStr(TEST_TOKEN)
    assert is_authorized(f"Bearer {TEST_TOKEN}", secret) and is_authorized(f"bearer {TEST_TOKEN}", secret)
    assert not is_authorized(None, secret) and not is_authorized(TEST_TOKEN, secret)


def test_no_token_means_no_control_listener(tiny_model):
    from tidal.worker.config import WorkerConfig
    from tidal.worker.process import assemble_worker

    config = WorkerConfig.from_flat(model_path=tiny_model("llama"), device="cpu")
    assert [listener.name for listener in assemble_worker(config).servers.listeners] == ["serving"]


def test_a_bad_token_setting_exits_2_without_echoing_it(tiny_model, capsys):
    from tidal.worker.cli import EXIT_BAD_CONFIG, main

    assert main(["--model", str(tiny_model("llama")), "--control-token", "tooshort"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "TIDAL_CONTROL_TOKEN" in err and "tooshort" not in err


def test_the_token_is_checked_before_the_body_or_the_route():
    from fastapi.testclient import TestClient

    from tidal.worker.control.app import build_control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.manager import LifecycleManager

    app = build_control_app(LifecycleManager(LifecycleConfig(weights_version="a")), SecretStr(TEST_TOKEN))
    with TestClient(app) as client:
        for method, path, body in (("POST", "/sleep", b"{not json"), ("GET", "/no-such-route", None)):
            response = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 401, path
            assert response.json()["code"] == "unauthorized" and response.headers["www-authenticate"] == "Bearer"
        authorized = {"Authorization": f"Bearer {TEST_TOKEN}"}
        assert client.get("/no-such-route", headers=authorized).status_code == 404
        assert client.get("/state", headers=authorized).json()["model_loaded"] is False


def test_every_code_has_one_status_and_every_refusal_answers_with_its_code():
    from fastapi.testclient import TestClient

    from tidal.worker.control.app import HTTP_STATUS, build_control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.errors import LifecycleError
    from tidal.worker.lifecycle.manager import LifecycleManager

    assert set(HTTP_STATUS) == set(ErrorCode), "every code the worker may send needs an HTTP status"
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())
    assert all(isinstance(error.code, ErrorCode) for error in LifecycleError.__subclasses__())
    app = build_control_app(LifecycleManager(LifecycleConfig(weights_version="a")), SecretStr(TEST_TOKEN))
    with TestClient(app, headers={"Authorization": f"Bearer {TEST_TOKEN}"}) as client:
        for method, path, code in (
            ("GET", "/no-such-route", ErrorCode.NOT_FOUND),
            ("DELETE", "/state", ErrorCode.METHOD_NOT_ALLOWED),
            ("POST", "/sleep", ErrorCode.NOT_LOADED),  # nothing loaded: a lifecycle refusal
            ("DELETE", "/weights/stream/nope", ErrorCode.UNKNOWN_UPLOAD),
        ):
            response = client.request(method, path, json={} if method == "POST" else None)
            error = ControlError.model_validate(response.json())
            assert (error.code, response.status_code) == (code, HTTP_STATUS[code]), response.text


def test_an_oversized_chunk_is_a_400_and_its_offset_is_taken_again(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    from tidal.worker.control import app as control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.manager import LifecycleManager

    monkeypatch.setattr(control_app, "MAX_CHUNK_BYTES", 8)
    manager = LifecycleManager(LifecycleConfig(weights_version="a", upload_dir=tmp_path))
    upload = manager.uploads.start(False)
    app = control_app.build_control_app(manager, SecretStr(TEST_TOKEN))
    path = f"/weights/stream/{upload.upload_id}/chunk?file=model.safetensors&offset=0"
    with TestClient(app, headers={"Authorization": f"Bearer {TEST_TOKEN}"}) as client:
        response = client.post(path, content=b"0123456789")
        assert response.status_code == 400 and response.json()["code"] == "invalid_request"
        assert "at most 8 bytes" in response.json()["message"]
        # Nothing was written, and the file is not left held by the refused chunk.
        assert upload.received == {} and not (upload.directory / "model.safetensors").exists()
        assert client.post(path, content=b"01234567").json()["received_bytes"] == 8
    manager.uploads.discard_current()


# A chunk's checks come before its body: the client below holds back all but a first piece until it has its answer,
# so a route that read the body first would wait for it (and the test would fail at its timeout, not hang).
_ANSWER_TIMEOUT_S = 5.0


class _HeldBody:
    """A chunk's body as a client sends it: a first piece, then the rest only once `release` is set."""

    def __init__(self, first: bytes, rest: bytes) -> None:
        self.first, self.rest = first, rest
        self.release = asyncio.Event()
        self.started = asyncio.Event()  # the server asked for the body
        self.pieces_taken = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.started.set()
        self.pieces_taken += 1
        yield self.first
        await self.release.wait()
        self.pieces_taken += 1
        yield self.rest


@contextlib.asynccontextmanager
async def _chunk_client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any, Any]]:
    """An in-process control app (no model: chunks need none) with one upload started, and a client to it."""
    from tidal.worker.control.app import build_control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.manager import LifecycleManager

    manager = LifecycleManager(LifecycleConfig(weights_version="a", upload_dir=tmp_path))
    upload = manager.uploads.start(False)
    transport = httpx.ASGITransport(app=build_control_app(manager, SecretStr(TEST_TOKEN)))
    headers = {"Authorization": f"Bearer {TEST_TOKEN}", "Content-Type": "application/octet-stream"}
    async with httpx.AsyncClient(transport=transport, base_url="http://control", headers=headers) as client:
        try:
            yield client, manager, upload
        finally:
            manager.uploads.discard_current()


def _post_chunk(
    client: httpx.AsyncClient, upload_id: str, file: str, offset: int, body: Any
) -> Coroutine[Any, Any, httpx.Response]:
    url = f"/weights/stream/{upload_id}/chunk"
    return client.post(url, params={"file": file, "offset": offset}, content=body)


@pytest.mark.parametrize(
    ("target", "file", "offset", "status", "code", "reason"),
    [
        ("unknown", "model.safetensors", 0, 404, ErrorCode.UNKNOWN_UPLOAD, "no upload 'not-the-upload' in progress"),
        ("current", "model.safetensors", 4, 409, ErrorCode.BAD_OFFSET, "chunk at offset 4, but 0 bytes"),
        ("current", "../model.safetensors", 0, 400, ErrorCode.INVALID_REQUEST, "file"),
    ],
)
def test_a_chunk_that_cannot_be_taken_is_refused_before_its_body_is_read(
    tmp_path, target, file, offset, status, code, reason
):
    async def scenario() -> None:
        async with _chunk_client(tmp_path) as (client, _, upload):
            upload_id = upload.upload_id if target == "current" else "not-the-upload"
            body = _HeldBody(b"0123", b"4567" * 1024)
            try:
                response = await asyncio.wait_for(_post_chunk(client, upload_id, file, offset, body), _ANSWER_TIMEOUT_S)
            finally:
                body.release.set()
            assert response.status_code == status, response.text
            error = ControlError.model_validate(response.json())
            assert error.code == code and reason in error.message, error
            assert body.pieces_taken == 0  # not a byte of the body was read
            assert upload.received == {} and not list(upload.directory.iterdir())

    asyncio.run(scenario())


def test_a_second_chunk_of_a_file_while_one_arrives_is_busy_and_other_files_go_on(tmp_path):
    async def scenario() -> None:
        async with _chunk_client(tmp_path) as (client, manager, upload):
            held = _HeldBody(b"0123", b"4567")
            first = asyncio.create_task(_post_chunk(client, upload.upload_id, "model.safetensors", 0, held))
            try:
                await asyncio.wait_for(held.started.wait(), _ANSWER_TIMEOUT_S)  # the first chunk's body is arriving
                second = await asyncio.wait_for(
                    _post_chunk(client, upload.upload_id, "model.safetensors", 0, b"abcdefgh"), _ANSWER_TIMEOUT_S
                )
                assert second.status_code == 409, second.text
                error = ControlError.model_validate(second.json())
                assert error.code == ErrorCode.BUSY and "still arriving" in error.message, error
                # Another file of the same upload is not held up.
                index = await asyncio.wait_for(
                    _post_chunk(client, upload.upload_id, "model.safetensors.index.json", 0, b"{}"), _ANSWER_TIMEOUT_S
                )
                assert index.status_code == 200 and index.json()["received_bytes"] == 2, index.text
            finally:
                held.release.set()
            answered = await asyncio.wait_for(first, _ANSWER_TIMEOUT_S)
            assert answered.status_code == 200 and answered.json()["received_bytes"] == 8, answered.text
            assert (upload.directory / "model.safetensors").read_bytes() == b"01234567"
            # Once the first was answered, the file takes chunks again: the next offset, not the same one twice.
            again = await _post_chunk(client, upload.upload_id, "model.safetensors", 0, b"abcdefgh")
            assert again.status_code == 409 and again.json()["code"] == ErrorCode.BAD_OFFSET, again.text
            more = await _post_chunk(client, upload.upload_id, "model.safetensors", 8, b"89")
            assert more.json()["received_bytes"] == 10, more.text
            assert manager.uploads.get(upload.upload_id).received == {
                "model.safetensors": 10,
                "model.safetensors.index.json": 2,
            }

    asyncio.run(scenario())


def test_a_chunk_whose_body_stops_arriving_is_a_408_and_leaves_its_file_free(tmp_path, monkeypatch):
    from tidal.worker.control import app as control_app

    monkeypatch.setattr(control_app, "CHUNK_IDLE_TIMEOUT_S", 0.2, raising=False)  # raising: for the code before it

    async def scenario() -> None:
        async with _chunk_client(tmp_path) as (client, _, upload):
            stalled = _HeldBody(b"0123", b"4567")  # a client gone without closing its connection
            try:
                response = await asyncio.wait_for(
                    _post_chunk(client, upload.upload_id, "model.safetensors", 0, stalled), _ANSWER_TIMEOUT_S
                )
                assert response.status_code == 408, response.text
                error = ControlError.model_validate(response.json())
                assert error.code == ErrorCode.INVALID_REQUEST and "0.2s" in error.message, error
                assert upload.received == {} and not (upload.directory / "model.safetensors").exists()
                # Its resend is taken while the stalled connection still holds back its body.
                resent = await asyncio.wait_for(
                    _post_chunk(client, upload.upload_id, "model.safetensors", 0, b"01234567"), _ANSWER_TIMEOUT_S
                )
                assert resent.status_code == 200 and resent.json()["received_bytes"] == 8, resent.text
            finally:
                stalled.release.set()

    asyncio.run(scenario())


def test_a_chunk_cancelled_while_its_claim_waits_for_the_lock_leaves_its_file_free(tmp_path):
    """The claim is made on a thread that waits for the uploads' lock (a write in progress); a request cancelled
    meanwhile (its client gone, the server stopping) must not leave the file claimed by a chunk that never comes,
    or every later chunk of the file is refused as busy."""

    async def scenario() -> None:
        async with _chunk_client(tmp_path) as (_, manager, upload):
            claimed = threading.Event()
            begin_chunk = manager.uploads.begin_chunk

            def begin_and_tell(*args: Any) -> Any:
                try:
                    return begin_chunk(*args)
                finally:
                    claimed.set()

            manager.uploads.begin_chunk = begin_and_tell

            async def chunk() -> None:
                async with manager.stream_chunk_arriving(upload.upload_id, "model.safetensors", 0):
                    raise AssertionError("cancelled before its claim was made")

            with manager.uploads._lock:  # a write of another file in progress
                request = asyncio.create_task(chunk())
                await asyncio.sleep(0.2)  # its claim's thread now waits for the lock
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            # The thread claims the file once the lock is free; the cancelled request gives the claim back.
            assert await asyncio.to_thread(claimed.wait, _ANSWER_TIMEOUT_S)
            deadline = time.monotonic() + _ANSWER_TIMEOUT_S
            while "model.safetensors" in manager.uploads.get(upload.upload_id).arriving:
                assert time.monotonic() < deadline, "the cancelled chunk still holds its file"
                await asyncio.sleep(0.01)
            await manager.stream_chunk(upload.upload_id, "model.safetensors", 0, b"0123")
            assert manager.uploads.get(upload.upload_id).received == {"model.safetensors": 4}

    asyncio.run(scenario())


def test_a_real_listener_answers_a_refused_chunk_before_its_body_and_keeps_the_connection(tiny_model):
    with ControlledWorker(model_path=tiny_model("llama"), num_kv_blocks=64) as worker:
        port = worker.background.servers.listener("control").bound_port
        body = b"x" * 1_000_000
        head = (
            f"POST /weights/stream/not-the-upload/chunk?file=model.safetensors&offset=0 HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {TEST_TOKEN}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=_ANSWER_TIMEOUT_S) as sock:
            sock.sendall(head + body[:1000])  # the rest is held back until the answer came
            answer = _one_response(sock)
            assert answer.startswith(b"HTTP/1.1 404 ") and b'"unknown_upload"' in answer, answer
            # The client sends the rest anyway (as most do): it is read and dropped, and the connection serves on.
            sock.sendall(body[1000:])
            sock.sendall(f"GET /state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n".encode())
            assert _one_response(sock).startswith(b"HTTP/1.1 200 ")


def _one_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, read off a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_the_architecture_doc_names_codes_with_the_status_they_answer_with():
    from tidal.worker.control.app import HTTP_STATUS

    text = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    pairs = re.findall(r"\b([45]\d\d)\s+`([a-z][a-z_]*)`", text)  # "409 `stale_epoch`", across line breaks too
    assert len(pairs) >= 4, "the pattern no longer finds the doc's codes"
    for status, code in pairs:
        assert code in set(ErrorCode), f"docs/ARCHITECTURE.md names {code}, which is not an ErrorCode"
        assert HTTP_STATUS[ErrorCode(code)] == int(status), f"docs/ARCHITECTURE.md says {status} {code}"


def test_the_control_listeners_connection_limits_answer_as_control_errors(tiny_model):
    # The held connection's headers stay unfinished for 2 s: time enough for the second one to be refused first.
    with ControlledWorker(
        model_path=tiny_model("llama"), num_kv_blocks=64, header_read_timeout_s=2, max_connections=1
    ) as worker:
        port = worker.background.servers.listener("control").bound_port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as held:
            held.sendall(b"GET /state HTTP/1.1\r\nHost: x\r\n")  # headers that never finish
            with socket.create_connection(("127.0.0.1", port), timeout=10) as second:
                request = f"GET /state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TEST_TOKEN}\r\n\r\n"
                second.sendall(request.encode())
                status, body = _status_and_body(second)
            assert status == 503
            assert ControlError.model_validate_json(body).code == ErrorCode.BUSY
            status, body = _status_and_body(held)
        assert status == 408
        assert ControlError.model_validate_json(body).code == ErrorCode.INVALID_REQUEST


def _status_and_body(sock: socket.socket) -> tuple[int, bytes]:
    """A whole response, read until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_the_control_api_binds_its_own_address_else_the_serving_host(tiny_model):
    from tidal.worker.config import WorkerConfig
    from tidal.worker.process import assemble_worker

    def hosts(**flags: object) -> dict[str, str]:
        config = WorkerConfig.from_flat(model_path=tiny_model("llama"), device="cpu", control_token=TEST_TOKEN, **flags)
        return {listener.name: listener.host for listener in assemble_worker(config).servers.listeners}

    assert hosts(host="10.0.0.5") == {"serving": "10.0.0.5", "control": "10.0.0.5"}
    assert hosts(host="0.0.0.0", control_host="127.0.0.1") == {"serving": "0.0.0.0", "control": "127.0.0.1"}


def test_a_token_in_the_query_string_is_refused_and_blanked_before_it_is_logged():
    from tidal.worker.control.app import build_control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.manager import LifecycleManager

    app = build_control_app(LifecycleManager(LifecycleConfig(weights_version="a")), SecretStr(TEST_TOKEN))
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    for query in (f"access_token={TEST_TOKEN}", f"recompute=1&Token={TEST_TOKEN}"):
        # uvicorn's access log writes the path and query of this very scope once the answer starts.
        scope = {"type": "http", "method": "GET", "path": "/state", "query_string": query.encode(), "headers": []}
        sent.clear()
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] == 400 and scope["query_string"] == b""
        assert b"Authorization header" in sent[1]["body"]  # type: ignore[operator]


def test_a_chunk_whose_client_disconnects_mid_body_is_logged_in_one_line_and_not_counted(tmp_path, caplog):
    import logging

    from tidal.worker.control.app import build_control_app
    from tidal.worker.lifecycle.config import LifecycleConfig
    from tidal.worker.lifecycle.manager import LifecycleManager

    manager = LifecycleManager(LifecycleConfig(weights_version="a", upload_dir=tmp_path))
    upload = manager.uploads.start(False)
    app = build_control_app(manager, SecretStr(TEST_TOKEN))
    arriving = [{"type": "http.request", "body": b"0123", "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {TEST_TOKEN}".encode()), (b"content-type", b"application/octet-stream")]
    path, query = f"/weights/stream/{upload.upload_id}/chunk", b"file=model.safetensors&offset=0"
    scope = {"type": "http", "method": "POST", "path": path, "query_string": query, "headers": headers}
    with caplog.at_level(logging.DEBUG):
        # An exception out of the app is what the server logs as "Exception in ASGI application", with its traceback.
        asyncio.run(app(scope, receive, send))
    records = [r for r in caplog.records if r.name.startswith("tidal")]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [r.getMessage() for r in records]
    told = [r for r in records if "disconnect" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno in (logging.INFO, logging.WARNING)
    assert "\n" not in told[0].getMessage()
    assert all(m.get("status") != 500 for m in sent if m["type"] == "http.response.start")
    # The chunk was not counted: the upload is as it was, and the chunk is sent again at the same offset.
    assert upload.received == {} and not (upload.directory / "model.safetensors").exists()
    assert manager.uploads.write_chunk(upload.upload_id, "model.safetensors", 0, b"0123").received == {
        "model.safetensors": 4
    }
    manager.uploads.discard_current()
