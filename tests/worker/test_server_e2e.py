"""The real server (uvicorn on 127.0.0.1) in front of the real engine with a tiny random Llama on the CPU.

Covers what only the whole stack can show: concurrent requests all finishing and counted in /metrics, an oversized
prompt answered with 400, a client that disconnects mid-stream freeing its sequence, /ready before the model is
loaded, and the command line serving end to end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.worker.config import WorkerConfig, WorkerEngineConfig
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.process import assemble_worker
from tidal.worker.server.background import BackgroundServers
from tidal.worker.server.config import ServerConfig
from tidal.worker.testing.tiny_models import write_tiny_model

MAX_MODEL_LEN = 256
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def worker_config(model_dir, **server) -> WorkerConfig:
    engine = WorkerEngineConfig(
        model_path=model_dir,
        served_model_name=MODEL,
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=512,
        max_num_seqs=64,
    )
    return WorkerConfig(engine=engine, server=ServerConfig(host="127.0.0.1", port=0, log_level="warning", **server))


def serve(config: WorkerConfig) -> BackgroundServers:
    return BackgroundServers(assemble_worker(config).servers).start()


@pytest.fixture(scope="module")
def worker(model_dir):
    local = serve(worker_config(model_dir, stream_write_timeout_s=10.0)).wait_ready()
    yield local
    assert local.stop() == 0


def metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(f"{name}{labels} not in /metrics")


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_load_hooks_run_once_loaded_before_ready(model_dir):
    """`on_loaded` (where the worker's entry point freezes its startup objects) runs once, with the engine started
    and before the worker reports ready, so no request's objects are frozen with the startup's."""
    servers = assemble_worker(worker_config(model_dir)).servers
    runtime = servers.runtime
    seen: list[tuple[bool, bool]] = []
    runtime.on_loaded.append(lambda: seen.append((runtime.is_ready, runtime.engine is None)))
    local = BackgroundServers(servers).start().wait_ready()
    try:
        assert seen == [(False, True)]
    finally:
        assert local.stop() == 0


def test_models_and_probes(worker):
    assert httpx.get(f"{worker.url()}/health").status_code == 200
    assert httpx.get(f"{worker.url()}/ready").status_code == 200
    models = httpx.get(f"{worker.url()}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_64_concurrent_requests_complete_and_are_counted(worker):
    base = worker.url()
    before = metric(base, "tidal_requests_total", endpoint="completions", outcome="length")
    tokens_before = metric(base, "tidal_generation_tokens_total")
    ttft_before = metric(base, "tidal_time_to_first_token_seconds_count")

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {"model": MODEL, "prompt": f"request number {i}", "max_tokens": 8, "ignore_eos": True, "seed": i}
        response = await client.post(f"{base}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def all_of_them() -> list[dict]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert len({r["id"] for r in results}) == 64
    for r in results:
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 8
    assert metric(base, "tidal_requests_total", endpoint="completions", outcome="length") == before + 64
    assert metric(base, "tidal_generation_tokens_total") == tokens_before + 64 * 8
    assert metric(base, "tidal_time_to_first_token_seconds_count") == ttft_before + 64
    assert metric(base, "tidal_e2e_request_latency_seconds_count") >= 64
    assert metric(base, "tidal_inter_token_latency_seconds_count") >= 64 * 7
    assert metric(base, "tidal_requests_running") == 0
    assert metric(base, "tidal_requests_waiting") == 0
    assert 0.0 <= metric(base, "tidal_kv_cache_usage_ratio") <= 1.0


@pytest.mark.parametrize("as_tokens", [True, False])
def test_oversized_prompt_is_a_400(worker, as_tokens):
    prompt = [5] * (MAX_MODEL_LEN + 10) if as_tokens else "hello world " * 400
    response = httpx.post(f"{worker.url()}/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"max_model_len is {MAX_MODEL_LEN}" in error["message"]
    # The server is still serving.
    ok = httpx.post(f"{worker.url()}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_engine_refusal_is_a_400(worker):
    response = httpx.post(f"{worker.url()}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 10**6]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_prompt"
    assert "outside the vocabulary" in response.json()["error"]["message"]


def test_unknown_model_is_a_404(worker):
    response = httpx.post(f"{worker.url()}/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_disconnect_mid_stream_frees_the_sequence(worker):
    engine = worker.servers.runtime.engine
    base = worker.url()
    aborted_before = metric(base, "tidal_requests_total", endpoint="completions", outcome="cancelled")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        chunks: list[dict] = []
        for line in lines:
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == 3:
                break
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert engine.stats().num_running == 1  # still generating when the client goes away
    # Leaving the `with` closed the connection mid-stream.
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
    assert wait_until(
        lambda: metric(base, "tidal_requests_total", endpoint="completions", outcome="cancelled") == aborted_before + 1
    )
    assert metric(base, "tidal_requests_running") == 0


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_sequence(worker):
    engine = worker.servers.runtime.engine
    base = worker.url()
    aborted_before = metric(base, "tidal_requests_total", endpoint="chat_completions", outcome="cancelled")
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 220, "ignore_eos": True}
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", worker.servers.listener("serving").bound_port)) as sock:
        sock.sendall(request)
        assert wait_until(lambda: engine.stats().num_running == 1)
    # The socket is closed while the server is still collecting the answer.
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
    assert wait_until(
        lambda: (
            metric(base, "tidal_requests_total", endpoint="chat_completions", outcome="cancelled") == aborted_before + 1
        )
    )


def test_a_client_that_never_reads_does_not_hold_its_sequence(worker):
    engine = worker.servers.runtime.engine
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the smallest window the kernel allows
        sock.connect(("127.0.0.1", worker.servers.listener("serving").bound_port))
        sock.sendall(request)
        assert wait_until(lambda: engine.stats().num_running == 1)
        # The engine never waits on a client: the sequence ends (and frees its blocks) while nothing was read.
        assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0, timeout_s=30)


def test_a_model_that_fails_to_load_ends_the_servers_with_exit_code_1(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    local = serve(worker_config(tmp_path))
    with pytest.raises(RuntimeError, match="exited with code 1"):
        local.wait_ready(timeout_s=60)
    assert local.stop() == 1
    assert local.servers.runtime.failure is not None
    # What the command line writes as the container's termination message.
    assert local.servers.failure == f"loading the model failed: {local.servers.runtime.failure}"


def test_ready_is_503_until_the_model_is_loaded(model_dir, monkeypatch):
    gate = threading.Event()
    load_engine = LifecycleManager.load_engine

    def gated_load(manager, engine_config):
        # Holds the real load back so the test can look at the server while the model is "still loading".
        if not gate.wait(60):
            raise TimeoutError("test gate never opened")
        return load_engine(manager, engine_config)

    monkeypatch.setattr(LifecycleManager, "load_engine", gated_load)
    local = serve(worker_config(model_dir))
    try:
        assert wait_until(lambda: _status(f"{local.url()}/health") == 200)
        assert _status(f"{local.url()}/ready") == 503
        response = httpx.post(f"{local.url()}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 503
        gate.set()
        local.wait_ready()
        assert _status(f"{local.url()}/ready") == 200
    finally:
        gate.set()
        assert local.stop() == 0


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def test_command_line_serves_and_stops_on_sigterm(model_dir):
    env = {**os.environ, "TIDAL_MODEL": str(model_dir), "TIDAL_DEVICE": "cpu", "TIDAL_MAX_MODEL_LEN": "128"}
    env["TIDAL_NUM_KV_BLOCKS"] = "64"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.worker", "--host", "127.0.0.1", "--port", "0", "--served-model-name", "cli"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = None
        for line in proc.stderr:  # the log line names the port that 0 turned into
            if match := re.search(r"serving API on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None, "the worker never said where it listens"
        # Keep reading its log so that a full pipe never blocks the worker.
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _status(f"{base}/ready") == 200, timeout_s=120)
        body = {"model": "cli", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
