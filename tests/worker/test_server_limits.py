"""Limits that need the model (tiny random Llama on the CPU): prompt building off the event loop, the prompt-token
limit (and the text refused by it before it is tokenized), the bound on requests admitted at once, and what
`chat_template_kwargs` may set.

A slow tokenizer is made deterministic by holding the real one on an event for chosen prompts: a server that
tokenizes on its event loop cannot answer anything until the test lets go, so each check waits a few seconds at most
where a fixed server answers in milliseconds.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tidal.worker.config import WorkerConfig
from tidal.worker.process import assemble_worker
from tidal.worker.server.background import BackgroundServers
from tidal.worker.server.errors import ApiError
from tidal.worker.server.prompts import PromptBuilder, check_template_kwargs
from tidal.worker.server.protocol import ChatMessage
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny"
MAX_PROMPT_TOKENS = 32
MAX_CONCURRENT = 2
HELD = "hold"  # prompts that start with this wait in the tokenizer until the test releases them
CLIENT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    config = WorkerConfig.from_flat(
        model_path=model_dir, served_model_name=MODEL, device="cpu", dtype="float32", max_model_len=256,
        num_kv_blocks=128, host="127.0.0.1", port=0, log_level="warning", max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_concurrent_requests=MAX_CONCURRENT, overload_retry_after_s=2, tokenizer_threads=4,
    )  # fmt: skip
    running = BackgroundServers(assemble_worker(config).servers).start().wait_ready()
    yield running
    assert running.stop() == 0


class HeldTokenizer:
    """Holds the engine's tokenizer on `release` for texts that start with HELD (in `encode` or, for chat, in
    `apply_chat_template`); `entered` counts the held calls."""

    def __init__(self, worker, monkeypatch, method: str) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        tokenizer = worker.servers.runtime.engine.tokenizer
        real = getattr(tokenizer, method)

        def held(first, *args, **kwargs):
            text = first if isinstance(first, str) else first[-1]["content"]
            if text.startswith(HELD):
                self.entered.release()
                self.release.wait(30)
            return real(first, *args, **kwargs)

        monkeypatch.setattr(tokenizer, method, held)

    def wait_entered(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=10), "the held prompt never reached the tokenizer"


def _body(endpoint: str, text: str, **extra) -> dict:
    if endpoint == "chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}
    return {"model": MODEL, "prompt": text, **extra}


def _post(worker, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{worker.url()}/v1/{endpoint}", json=body, timeout=CLIENT_TIMEOUT_S)


def _in_background(call) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize(
    ("endpoint", "method"), [("completions", "encode"), ("chat/completions", "apply_chat_template")]
)
def test_a_prompt_being_built_holds_no_other_request(worker, monkeypatch, endpoint, method):
    tokenizer = HeldTokenizer(worker, monkeypatch, method)
    # Over max_prompt_tokens (about 100 tokens), but not by its floor (364 bytes may be 22 tokens): refused once built.
    big = HELD + " the tide comes in" * 20
    thread, result = _in_background(lambda: _post(worker, endpoint, _body(endpoint, big)))
    try:
        tokenizer.wait_entered()
        start = time.perf_counter()
        assert httpx.get(f"{worker.url()}/health", timeout=CLIENT_TIMEOUT_S).status_code == 200
        small = _post(worker, endpoint, _body(endpoint, "hi", max_tokens=2))
        assert small.status_code == 200, small.text
        # Built on the event loop, the held prompt kept both waiting until the client gave up.
        assert time.perf_counter() - start < 3.0
    finally:
        tokenizer.release.set()
        thread.join(30)
    refused = result[0]
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"accepts at most {MAX_PROMPT_TOKENS} (max_prompt_tokens)" in error["message"]


@pytest.mark.parametrize("as_ids", [True, False])
def test_prompts_over_max_prompt_tokens_are_refused(worker, as_ids):
    over = [5] * (MAX_PROMPT_TOKENS + 1) if as_ids else "the tide comes in " * 40
    response = _post(worker, "completions", {"model": MODEL, "prompt": over})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "max_prompt_tokens" in response.json()["error"]["message"]
    at_limit = _post(worker, "completions", {"model": MODEL, "prompt": [5] * MAX_PROMPT_TOKENS, "max_tokens": 1})
    assert at_limit.status_code == 200, at_limit.text


def _recorded_encodes(worker, monkeypatch) -> list[str]:
    """The texts the engine's tokenizer encodes from now on."""
    tokenizer = worker.servers.runtime.engine.tokenizer
    real = tokenizer.encode
    texts: list[str] = []

    def recording(text, *args, **kwargs):
        texts.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return texts


# 18,000 bytes, and no token of the tiny tokenizer stands for more than 17: at least 1,059 tokens, over 32.
CANNOT_FIT = "the tide comes in " * 1000


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": CANNOT_FIT}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", CANNOT_FIT]}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": CANNOT_FIT}]}, "messages"),
        ("/tokenize", {"prompt": CANNOT_FIT}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": CANNOT_FIT}]}, "messages"),
    ],
)
def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(worker, monkeypatch, path, body, param):
    # Tokenizing 8 MB of such text held a tokenizer thread for 12 s, only for the same 400.
    encoded = _recorded_encodes(worker, monkeypatch)
    response = httpx.post(f"{worker.url()}{path}", json=body, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    assert error["message"].startswith("the prompt has at least ")
    assert error["message"].endswith(f" tokens but this worker accepts at most {MAX_PROMPT_TOKENS} (max_prompt_tokens)")
    if body.get("prompt") == CANNOT_FIT:
        assert "at least 1059 tokens" in error["message"]
    assert [text for text in encoded if CANNOT_FIT in text] == []


def test_a_request_stops_tokenizing_at_its_first_prompt_over_the_limit(worker, monkeypatch):
    encoded = _recorded_encodes(worker, monkeypatch)
    over = "the tide comes in " * 20  # about 80 tokens, though its floor (22) may fit: found only by tokenizing
    response = _post(worker, "completions", {"model": MODEL, "prompt": [over + "one", over + "two", over + "three"]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "accepts at most 32 (max_prompt_tokens)" in response.json()["error"]["message"]
    # The others were never tokenized: a list of texts each just short of the floor costs one of them, not all.
    assert encoded == [over + "one"]


def test_requests_beyond_the_admission_bound_get_429_and_slots_come_back(worker, monkeypatch):
    # Refusals of every kind first: none may keep its slot, or the bound below is reached early.
    assert _post(worker, "completions", {"model": MODEL, "prompt": [5] * 100}).status_code == 400
    assert _post(worker, "completions", {"model": MODEL, "prompt": [1, 10**6]}).status_code == 400
    kwargs = {"chat_template_kwargs": {"chat_template": "x"}}
    assert _post(worker, "chat/completions", _body("chat/completions", "hi", **kwargs)).status_code == 400
    engine = worker.servers.runtime.engine
    stream_body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{worker.url()}/v1/completions", json=stream_body, timeout=CLIENT_TIMEOUT_S) as r:
        next(r.iter_lines())  # and leave mid-stream
    # Its slot goes back before the engine hears of the abort, so once the engine is idle the slot is free.
    deadline = time.monotonic() + 10
    while engine.stats().num_running or engine.stats().num_waiting:
        assert time.monotonic() < deadline, "the abandoned stream was never aborted"
        time.sleep(0.02)
    for _ in range(3):
        assert _post(worker, "completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200

    tokenizer = HeldTokenizer(worker, monkeypatch, "encode")
    held = [_in_background(lambda: _post(worker, "completions", _body("completions", HELD, max_tokens=2)))]
    held.append(_in_background(lambda: _post(worker, "completions", _body("completions", HELD, max_tokens=2))))
    try:
        tokenizer.wait_entered(MAX_CONCURRENT)
        refused = _post(worker, "completions", {"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "too_many_requests"
        assert "max_concurrent_requests" in refused.json()["error"]["message"]
    finally:
        tokenizer.release.set()
        for thread, _ in held:
            thread.join(30)
    assert [result[0].status_code for _, result in held] == [200, 200]
    assert _post(worker, "completions", {"model": MODEL, "prompt": "again", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "refused_key"),
    [
        ({"chat_template": "{{ 'my own template' }}"}, "chat_template"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"documents": [{"title": "t", "text": "x"}]}, "documents"),
        ({"tokenize": True}, "tokenize"),
        ({"return_tensors": "pt"}, "return_tensors"),
        ({"messages": []}, "messages"),
    ],
)
def test_chat_template_kwargs_may_only_set_template_variables(worker, kwargs, refused_key):
    response = _post(worker, "chat/completions", _body("chat/completions", "hi", chat_template_kwargs=kwargs))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "chat_template_kwargs_refused"
    assert error["param"] == f"chat_template_kwargs.{refused_key}"


def test_template_variables_pass(worker):
    kwargs = {"enable_thinking": False, "custom_flag": "x"}
    response = _post(
        worker, "chat/completions", _body("chat/completions", "hi", max_tokens=2, chat_template_kwargs=kwargs)
    )
    assert response.status_code == 200, response.text


def test_an_operator_may_allow_request_templates_but_not_the_call_arguments(worker):
    tokenizer = worker.servers.runtime.engine.tokenizer
    builder = PromptBuilder(1, allow_request_chat_template=True)
    try:
        messages = [ChatMessage(role="user", content="hi")]
        template = {"chat_template": "X{{ messages[0]['content'] }}"}
        ids = asyncio.run(builder.chat_ids(tokenizer, messages, False, template))
        assert ids == tokenizer.encode("Xhi", add_special_tokens=False)
    finally:
        builder.close()
    with pytest.raises(ApiError, match="not a template variable"):
        check_template_kwargs(tokenizer, {"tokenize": True}, allow_request_chat_template=True)
