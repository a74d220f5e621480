"""Request validation and the probes, on the real app before any model is loaded (no engine involved).

FastAPI validates a body before the handler runs, so every 400 below is the server's answer whatever the engine's
state; /ready and the generation routes must say 503 while the model is loading.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tidal.worker.layers.expert_exchange import ExchangeSnapshot, ExchangeTotals
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import build_api_app
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.worker.server.runtime import Phase, WorkerRuntime
from tidal.worker.testing.engine_stats import idle_engine_stats


def _api_app(runtime, metrics):
    return build_api_app(runtime, metrics, ServerConfig(stream_write_timeout_s=5.0), PromptBuilder(1))


def _never_loads():
    raise AssertionError("these tests never load a model")


@pytest.fixture
def loading_app():
    runtime = WorkerRuntime(_never_loads)
    metrics = WorkerMetrics(CollectorRegistry(), runtime.stats)
    with TestClient(_api_app(runtime, metrics)) as client:
        yield client, runtime, metrics


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "expected_param", "expected_text"),
    [
        ("/v1/completions", {"model": "m"}, "prompt", "Field required"),
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 17}, "n", "less than or equal to 16"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "greater than or equal to 1"),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "max_tokens": -1},
            "max_tokens",
            "greater than or equal to 0",
        ),
        ("/v1/completions", {"model": "m", "prompt": ["a"] * 65}, "prompt", "at most 64 prompts"),
        ("/v1/completions", {"model": "m", "prompt": ["a"] * 9, "n": 16}, None, "at most 128 are allowed"),
        ("/v1/completions", {"model": "m", "prompt": [[1], [2, -1]]}, "prompt", "non-negative"),
        ("/v1/completions", {"model": "m", "prompt": [[1], []]}, "prompt", "non-empty list of token ids"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt", "prompt must not be empty"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop": ["a"] * 65}, "stop", "at most 64 stop sequences"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop": ["a" * 129]}, "stop", "at most 128 characters"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [1] * 257}, "stop_token_ids", "256"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"ab": 1}}, "logit_bias", "key 'ab' is not"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"-3": 1}}, "logit_bias", "key '-3' is not"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "of '5' must be"),
        (  # past int()'s 4300 digits: a 500 before its length was checked
            "/v1/completions",
            {"model": "m", "prompt": "x", "logit_bias": {"1" * 4301: 1}},
            "logit_bias",
            "key '11111111111111111111...' (4301 digits) is not a token id of this model",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "logit_bias": {"9" * 19: 1}},
            "logit_bias",
            "key '9999999999999999999' is not a token id of this model",
        ),
        ("/v1/completions", {"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "than 0"),
        ("/v1/completions", {"model": "m", "prompt": "x", "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ("/v1/completions", {"model": "m", "prompt": "x", "min_tokens": 20}, None, "min_tokens (20) must not exceed"),
        ("/v1/completions", {"model": "m", "prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", "-2"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, None, "only allowed with echo"),
        ("/v1/completions", {"model": "m", "prompt": "x", "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, None, "stream"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages", "at least 1 item"),
        ("/tokenize", {"prompt": "x", "messages": CHAT["messages"]}, None, "exactly one of prompt and messages"),
        ("/tokenize", {}, None, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1", "greater than or equal to 0"),
        ("/detokenize", {}, "tokens", "Field required"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "user"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, None, "tool_choice required needs tools"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, None, "disagree"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 4, "min_tokens": 5}, None, "must not exceed"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
            "only text content parts",
        ),
    ],
)
def test_invalid_requests_get_400_with_the_reason(loading_app, path, body, expected_param, expected_text):
    client, _, _ = loading_app
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == expected_param
    assert expected_text in error["message"]


def test_malformed_json_is_a_400(loading_app):
    client, _, _ = loading_app
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in _error(response)["message"]


def test_rejected_requests_are_counted(loading_app):
    client, _, _ = loading_app
    client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 17})
    client.post("/v1/chat/completions", json={"model": "m"})
    text = client.get("/metrics").text
    assert 'tidal_requests_total{endpoint="completions",outcome="rejected"} 1.0' in text
    assert 'tidal_requests_total{endpoint="chat_completions",outcome="rejected"} 1.0' in text


def test_probes_while_loading(loading_app):
    client, runtime, _ = loading_app
    assert runtime.phase is Phase.LOADING
    assert client.get("/health").status_code == 200
    ready = client.get("/ready")
    assert ready.status_code == 503
    assert ready.json()["phase"] == "loading"
    for response in (
        client.get("/v1/models"),
        client.post("/v1/completions", json={"model": "m", "prompt": "x"}),
        client.post("/tokenize", json={"prompt": "x"}),
        client.post("/detokenize", json={"tokens": [1]}),
    ):
        assert response.status_code == 503
        assert "still loading" in _error(response)["message"]


def test_metrics_without_engine_have_request_series_but_no_engine_gauges(loading_app):
    client, _, _ = loading_app
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "tidal_time_to_first_token_seconds_bucket" in response.text
    assert "tidal_requests_running" not in response.text


def test_two_metric_sets_do_not_collide():
    # Each server owns its registry: building two in one process must not raise "Duplicated timeseries".
    first = WorkerMetrics(CollectorRegistry(), lambda: None)
    second = WorkerMetrics(CollectorRegistry(), lambda: None)
    first.record_finished("completions", "stop")
    assert b'outcome="stop"} 1.0' in first.render()[0]
    assert b'outcome="stop"} 0.0' in second.render()[0]


def test_expert_exchange_series_count_what_a_rank_exchanged_and_seconds_only_when_timed():
    def scrape(exchanges: ExchangeSnapshot | None) -> str:
        return WorkerMetrics(CollectorRegistry(), lambda: idle_engine_stats(exchanges)).render()[0].decode()

    def snapshot(dispatch_s: float | None, combine_s: float | None) -> ExchangeSnapshot:
        dispatch = ExchangeTotals("dispatch", 96, 4000, 3000, dispatch_s)
        return ExchangeSnapshot(32, (dispatch, ExchangeTotals("combine", 96, 2900, 3900, combine_s)))

    alone = scrape(None)  # no expert parallelism: zeros, no seconds
    assert "tidal_expert_parallel_steps_total 0.0" in alone
    assert 'tidal_expert_exchange_bytes_total{direction="sent",phase="combine"} 0.0' in alone
    assert "tidal_expert_exchange_seconds" not in alone
    untimed = scrape(snapshot(None, None))
    assert "tidal_expert_parallel_steps_total 32.0" in untimed
    assert 'tidal_expert_exchanges_total{phase="dispatch"} 96.0' in untimed
    assert 'tidal_expert_exchange_bytes_total{direction="sent",phase="dispatch"} 4000.0' in untimed
    assert 'tidal_expert_exchange_bytes_total{direction="received",phase="combine"} 3900.0' in untimed
    assert "tidal_expert_exchange_seconds" not in untimed  # never an untimed zero
    assert 'tidal_expert_exchange_seconds_total{phase="combine"} 0.5' in scrape(snapshot(0.25, 0.5))


def test_request_models_normalise_openai_forms():
    assert CompletionRequest(model="m", prompt="only").prompts == ["only"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(model="m", prompt=["only"]).prompts == ["only"]
    assert CompletionRequest(model="m", prompt=[[1, 2, 3]]).prompts == [[1, 2, 3]]
    assert CompletionRequest(model="m", prompt=["a", "b"], n=2).prompts == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    assert CompletionRequest(model="m", prompt="x", stop="END").stop == ["END"]
    chat = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7,
    )
    assert chat.messages[0].text == "ab"
    assert chat.token_limit == 7
    with pytest.raises(ValidationError, match="disagree"):
        ChatCompletionRequest(model="m", messages=CHAT["messages"], max_tokens=3, max_completion_tokens=4)


def test_runtime_failure_is_reported_by_ready():
    def broken_loader():
        raise FileNotFoundError("no weights in /nowhere")

    runtime = WorkerRuntime(broken_loader)
    metrics = WorkerMetrics(CollectorRegistry(), runtime.stats)
    with pytest.raises(FileNotFoundError):
        asyncio.run(runtime.load())
    assert runtime.phase is Phase.FAILED
    with TestClient(_api_app(runtime, metrics)) as client:
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert "no weights" in ready.json()["reason"]
        assert "failed to load" in _error(client.get("/v1/models"))["message"]


def test_sampling_params_from_requests():
    from tidal.worker.server.errors import ApiError
    from tidal.worker.server.sampling import sampling_params

    completion = CompletionRequest(model="m", prompt="x", max_tokens=100, top_k=0, stop="END", temperature=0)
    params = sampling_params(completion, num_prompt_tokens=200, max_model_len=256, vocab_size=1000)
    assert params.max_tokens == 56  # capped by what is left of the context
    assert (params.top_k, params.stop, params.temperature) == (-1, ["END"], 0.0)
    chat = ChatCompletionRequest(model="m", messages=CHAT["messages"], top_k=5, seed=3)
    params = sampling_params(chat, num_prompt_tokens=10, max_model_len=256, vocab_size=1000)
    assert (params.max_tokens, params.top_k, params.seed) == (246, 5, 3)  # no limit given: up to the context
    # An oversized prompt still gets a valid budget, so that the engine's own refusal reaches the client.
    assert sampling_params(chat, num_prompt_tokens=300, max_model_len=256, vocab_size=1000).max_tokens == 1
    with pytest.raises(ApiError, match="seed must be >= 0") as refused:
        sampling_params(
            CompletionRequest(model="m", prompt="x", seed=-1), num_prompt_tokens=1, max_model_len=256, vocab_size=1000
        )
    assert refused.value.status == 400


def test_sampling_controls_reach_the_engine_params():
    from tidal.worker.server.errors import ApiError
    from tidal.worker.server.sampling import sampling_params

    chat = ChatCompletionRequest(
        model="m", messages=CHAT["messages"], max_completion_tokens=50, presence_penalty=0.5, frequency_penalty=-1,
        repetition_penalty=1.1, logit_bias={"7": -100, "12": 2.5}, min_p=0.1, min_tokens=40, user="someone",
        stop=[f"s{i}" for i in range(10)], stop_token_ids=[3], include_stop_str_in_output=True,
    )  # fmt: skip
    params = sampling_params(chat, num_prompt_tokens=220, max_model_len=256, vocab_size=1000)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.1)
    assert params.logit_bias == {7: -100.0, 12: 2.5}
    assert (params.min_p, params.stop_token_ids, params.include_stop_str_in_output) == (0.1, [3], True)
    assert len(params.stop) == 10
    assert (params.max_tokens, params.min_tokens) == (36, 36)  # both capped by what is left of the context
    padded = CompletionRequest(model="m", prompt="x", logit_bias={"0" * 5000 + "7": 1})  # int() counts the zeros
    assert sampling_params(padded, num_prompt_tokens=1, max_model_len=256, vocab_size=1000).logit_bias == {7: 1.0}
    too_big = CompletionRequest(model="m", prompt="x", logit_bias={"5": 1, "1000": 2})
    with pytest.raises(ApiError, match="logit_bias key '1000' is not a token id of this model") as refused:
        sampling_params(too_big, num_prompt_tokens=1, max_model_len=256, vocab_size=1000)
    assert (refused.value.status, refused.value.param) == (400, "logit_bias")
