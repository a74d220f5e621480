"""What the two HTTP APIs answer and what their OpenAPI documents say agree, on the points a contract test found
apart: 405's Allow header, 400 (not FastAPI's 422) for a bad body, the control API's token and refusals, /metrics'
media type, strict numbers in control requests, and the code a streamed error carries. The fuzzing of both documents
is in test_api_fuzz.py."""

from __future__ import annotations

import asyncio
import types

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tidal.contract.control_api import (
    MAX_EPOCH,
    CollectiveUpdateRequest,
    GroupMember,
    GroupReconfigureRequest,
    SleepRequest,
    WeightsUpdateRequest,
)
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import build_api_app
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.errors import ApiError
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.runtime import WorkerRuntime
from tidal.worker.server.streaming import chat_events, completion_events


def _never_loads():
    raise AssertionError("these tests never load a model")


@pytest.fixture(scope="module")
def serving_app():
    runtime = WorkerRuntime(_never_loads)
    metrics = WorkerMetrics(CollectorRegistry(), runtime.stats)
    app = build_api_app(runtime, metrics, ServerConfig(), PromptBuilder(1))
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def control_document():
    # The document is built from the routes alone; no manager method runs.
    from pydantic import SecretStr

    from tidal.worker.control.app import build_control_app

    app = build_control_app(manager=None, token=SecretStr("t" * 20))  # type: ignore[arg-type]
    return app.openapi()


def _operations(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_a_405_names_the_allowed_methods(serving_app):
    response = serving_app.delete("/v1/models")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_serving_document_says_400_with_openais_error_body(serving_app):
    document = serving_app.get("/openapi.json").json()
    for path, method, operation in _operations(document):
        assert "422" not in operation["responses"], (method, path)
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in document["paths"]["/ready"]["get"]["responses"]


def test_the_metrics_answer_is_the_documented_text(serving_app):
    assert serving_app.get("/metrics").headers["content-type"].startswith("text/plain")


def test_the_control_document_declares_the_token_and_each_routes_refusals(control_document):
    assert control_document["security"] == [{"bearerToken": []}]
    assert control_document["components"]["securitySchemes"]["bearerToken"] == {"type": "http", "scheme": "bearer"}
    for path, method, operation in _operations(control_document):
        responses = operation["responses"]
        assert "401" in responses, (method, path)
        for status, response in responses.items():
            if status.startswith(("4", "5")):
                schema = response["content"]["application/json"]["schema"]["$ref"]
                assert schema.endswith("/ControlError"), (method, path, status)
    update = control_document["paths"]["/weights/update"]["post"]["responses"]
    assert {"400", "401", "409", "422", "503"} <= set(update)  # 422: bad_checkpoint, the route's own
    assert "bad_checkpoint" in update["422"]["description"]
    reconfigure = control_document["paths"]["/group/reconfigure"]["post"]["responses"]
    assert "stale_epoch" in reconfigure["409"]["description"]
    chunk = control_document["paths"]["/weights/stream/{upload_id}/chunk"]["post"]
    assert "application/octet-stream" in chunk["requestBody"]["content"]
    file_param = next(p for p in chunk["parameters"] if p["name"] == "file")
    assert file_param["schema"]["pattern"].endswith(r"\.(safetensors|json)$")
    assert "HTTPValidationError" not in control_document["components"]["schemas"]


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (GroupMember, {"rank": False, "address": "a:1"}),
        (GroupMember, {"rank": "1", "address": "a:1"}),
        (SleepRequest, {"level": True}),
        (SleepRequest, {"drain_timeout_s": True}),
        (WeightsUpdateRequest, {"source": "/w", "version": "v", "allow_extra_tensors": "yes"}),
        (GroupReconfigureRequest, {"epoch": True, "members": [{"rank": 0, "address": "a:1"}], "coordinator_rank": 0}),
        (
            CollectiveUpdateRequest,
            {
                "master_address": "h",
                "master_port": 1,
                "rank": True,
                "world_size": 2,
                "version": "v",
                "tensors": [{"name": "w", "shape": [1], "dtype": "float32"}],
            },
        ),
    ],
)
def test_control_requests_take_numbers_and_flags_strictly(model, body):
    with pytest.raises(ValidationError):
        model.model_validate(body)


def test_a_group_epoch_is_an_int64():
    # An epoch the operator's status cannot hold, once applied, made every later one stale until a restart.
    members = [{"rank": 0, "address": "a:1"}]
    with pytest.raises(ValidationError, match="less than or equal to 9223372036854775807"):
        GroupReconfigureRequest.model_validate({"epoch": 2**63, "members": members, "coordinator_rank": 0})
    largest = GroupReconfigureRequest.model_validate({"epoch": 2**63 - 1, "members": members, "coordinator_rank": 0})
    assert largest.epoch == MAX_EPOCH == 2**63 - 1


def test_control_requests_still_take_enum_strings_and_whole_floats():
    request = SleepRequest.model_validate({"level": 2, "mode": "abort", "drain_timeout_s": 5})
    assert request.level == 2 and request.mode.value == "abort" and request.drain_timeout_s == 5.0


class _Interrupted:
    """A request's choices, interrupted after one output (a sleep in mode abort)."""

    num_prompt_tokens = num_output_tokens = 0
    num_choices = 1

    async def outputs(self):
        raise ApiError(503, "the worker goes to sleep", code="interrupted")
        yield  # an async generator

    def generation_of(self, index):
        return types.SimpleNamespace(prompt_token_ids=[1])


class _PlainShape:
    """A request that asked for nothing besides text."""

    scores_only = False
    is_plain = True  # the fast chunks (sse_chunks.py)

    def token_ids(self, token_ids):
        return None

    def prompt_logprobs(self, generation):
        return None


@pytest.mark.parametrize("events", [completion_events, chat_events])
def test_a_streamed_error_carries_the_code_the_response_would_have(events):
    async def collect() -> list[str]:
        return [e async for e in events(_Interrupted(), "id", "m", False, _PlainShape())]  # type: ignore[arg-type]

    error = next(e for e in asyncio.run(collect()) if '"error"' in e)
    assert '"code":"interrupted"' in error and '"type":"service_unavailable"' in error


def test_fields_the_server_always_refuses_are_documented_as_their_default_only(serving_app):
    schemas = serving_app.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["suffix"]["type"] == "null"
    content = schemas["ChatMessage"]["properties"]["content"]["anyOf"]
    assert any(member.get("items", {}).get("title") == "TextPart" for member in content)


def test_logprobs_echo_and_token_ids_are_documented_with_their_bounds(serving_app):
    schemas = serving_app.get("/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert completion["echo"]["type"] == "boolean" and chat["logprobs"]["type"] == "boolean"
    fields = (completion["logprobs"], completion["prompt_logprobs"], chat["top_logprobs"], chat["prompt_logprobs"])
    for field in fields:
        bounded = next(m for m in field["anyOf"] if m.get("type") == "integer")
        assert bounded["minimum"] == 0 and bounded["maximum"] == 20
    assert completion["logprobs_mode"]["enum"] == ["raw", "processed"]
    assert completion["return_token_ids"]["type"] == chat["return_token_ids"]["type"] == "boolean"
    choice = schemas["CompletionChoice"]["properties"]
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"} <= set(choice)
    assert {"prompt_logprobs", "prompt_token_ids"} <= set(schemas["ChatCompletionResponse"]["properties"])


@pytest.mark.parametrize(
    "body",
    [
        {"suffix": "x"},
        {"best_of": 2},
    ],
)
def test_what_the_completions_document_excludes_is_refused_in_words(serving_app, body):
    response = serving_app.post("/v1/completions", json={"model": "m", "prompt": "x", **body})
    assert response.status_code == 400 and "not supported" in response.json()["error"]["message"]


def test_structured_outputs_are_documented_as_accepted(serving_app):
    schemas = serving_app.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        response_format = schemas[request]["properties"]["response_format"]
        formats = next(member for member in response_format["anyOf"] if "oneOf" in member)
        assert set(formats["discriminator"]["mapping"]) == {"text", "json_object", "json_schema"}
    assert set(schemas["JsonSchemaSpec"]["properties"]) == {"name", "description", "schema", "strict"}
    extension = schemas["StructuredOutputs"]["properties"]
    assert set(extension) == {"json", "json_object", "regex", "choice", "grammar"}
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        assert "structured_outputs" in schemas[request]["properties"]


def test_tool_calling_is_documented_as_accepted(serving_app):
    schemas = serving_app.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    tools = next(member for member in chat["tools"]["anyOf"] if member.get("type") == "array")
    assert tools["items"]["$ref"].endswith("/ChatTool") and tools["maxItems"] == 128
    assert schemas["FunctionDefinition"]["properties"]["name"]["pattern"] == "^[a-zA-Z0-9_-]{1,64}$"
    choices = chat["tool_choice"]["anyOf"]
    assert {"type": "string", "enum": ["none", "auto", "required"]} in choices
    assert any(member.get("$ref", "").endswith("/NamedToolChoice") for member in choices)
    message = schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in message and {"type": "null"} in message["content"]["anyOf"]
    assert "tool_calls" in schemas["ChatChoice"]["properties"]["finish_reason"]["anyOf"][0]["enum"]
