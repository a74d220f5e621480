"""Tool fields of a chat request: what is accepted, the 400s of what cannot work, the forced-call structural tag, and
how a choice's text becomes a message (whole and streamed); text no parser or tokenizer takes (a lone surrogate, JSON
nested too deeply) is the client's error or plain content, never a 500."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tidal.worker.server.errors import ApiError
from tidal.worker.server.prompts import chat_prompt_ids, completion_prompt_ids, text_token_ids
from tidal.worker.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tidal.worker.server.sampling import forced_tool_calls, structured_output
from tidal.worker.server.shaping import ChatShape
from tidal.worker.server.tool_calls import llama, mistral, qwen
from tidal.worker.server.tool_calls.format import parse_output

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "today's weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _request(**fields):
    return ChatCompletionRequest.model_validate({**BASE, **fields})


def test_tools_default_to_auto_and_none_turns_them_off():
    assert _request(tools=[WEATHER]).tool_mode == "auto"
    assert _request(tools=[WEATHER], tool_choice="none").tool_mode == "none"
    assert _request().tool_mode == "none"
    assert _request(tools=[], tool_choice="none").tool_mode == "none"


def test_a_named_choice_forces_that_tool_alone():
    request = _request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert request.tool_mode == "named"
    assert [f.name for f in request.forced_tools] == ["get_time"]
    assert request.forced_tools[0].parameters_schema == {"type": "object", "properties": {}}
    assert not request.allows_parallel_calls


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [WEATHER, WEATHER]}, "tool names must be unique; repeated: get_weather"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "should match pattern"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "should match pattern"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "valid dictionary"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "parameters must be a JSON schema of type object",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "'function'"),
        ({"tool_choice": "required"}, "tool_choice required needs tools"),
        ({"tool_choice": "auto", "tools": []}, "tool_choice auto needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "names function 'nope', which is not among the tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            },
            "cannot be combined with response_format",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "cannot be combined",
        ),
    ],
)
def test_requests_that_cannot_work_are_refused_with_the_reason(fields, message):
    with pytest.raises(ValidationError) as caught:
        _request(**fields)
    assert message in str(caught.value)


def test_auto_may_be_combined_with_a_response_format():
    request = _request(tools=[WEATHER], tool_choice="auto", response_format={"type": "json_object"})
    assert request.tool_mode == "auto"


@pytest.mark.parametrize("fmt", [qwen.FORMAT, llama.FORMAT, mistral.FORMAT])
def test_required_builds_one_structural_tag_over_every_tool(fmt):
    request = _request(tools=[WEATHER, TIME], tool_choice="required")
    spec = forced_tool_calls(request, fmt)
    tag = json.loads(spec.text)
    assert spec.kind == "structural_tag" and tag["type"] == "structural_tag"
    text = json.dumps(tag)
    assert "get_weather" in text and "get_time" in text and '"required": ["city"]' in text
    one = json.loads(
        forced_tool_calls(_request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), fmt).text
    )
    assert '"stop_after_first": true' in json.dumps(one)


def test_forcing_needs_a_known_format():
    with pytest.raises(ApiError, match="no known tool-call format"):
        forced_tool_calls(_request(tools=[WEATHER], tool_choice="required"), None)


class _Template:
    """A tokenizer whose template shows what it was given."""

    chat_template = "x"

    def apply_chat_template(self, conversation, **kwargs):
        self.seen = {"conversation": conversation, **kwargs}
        return "text"

    def encode(self, text, add_special_tokens=True):
        return [1]


def test_tools_and_replayed_calls_reach_the_template():
    messages = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}
                ],
            }
        ),
        ChatMessage(role="tool", content="cold", tool_call_id="call_1"),
    ]
    tokenizer = _Template()
    chat_prompt_ids(tokenizer, messages, True, None, tools=[WEATHER])
    assert tokenizer.seen["tools"] == [WEATHER]
    replayed = tokenizer.seen["conversation"][1]["tool_calls"][0]
    assert replayed["function"] == {"name": "f", "arguments": {"city": "Oslo"}}
    assert tokenizer.seen["conversation"][2]["tool_call_id"] == "call_1"


def _shape(**fields):
    return ChatShape(_request(tools=[WEATHER, TIME], **fields), SimpleNamespace(), qwen.FORMAT)  # type: ignore[arg-type]


TWO_CALLS = (
    'ok <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_a_whole_message_with_calls():
    message, finish = _shape().message(TWO_CALLS, "stop")
    assert finish == "tool_calls" and message.content == "ok "
    dumped = message.model_dump()
    assert [c["function"]["name"] for c in dumped["tool_calls"]] == ["get_time", "get_weather"]
    assert json.loads(dumped["tool_calls"][1]["function"]["arguments"]) == {"city": "Oslo"}
    assert "tool_calls" not in _shape().message("no calls", "stop")[0].model_dump()
    assert _shape().message(TWO_CALLS, "length")[1] == "length"


def test_without_parallel_calls_only_the_first_counts():
    message, _ = _shape(parallel_tool_calls=False).message(TWO_CALLS, "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    shape = _shape(parallel_tool_calls=False)
    deltas = [shape.stream_delta(0, ch, False)[1] for ch in TWO_CALLS] + [shape.stream_delta(0, "", True)[1]]
    assert [d.function.name for ds in deltas for d in ds if d.function.name] == ["get_time"]


def test_streamed_calls_are_a_name_delta_then_an_arguments_delta():
    shape = _shape()
    content, deltas = "", []
    for piece in (TWO_CALLS[:7], TWO_CALLS[7:40], TWO_CALLS[40:]):
        text, calls = shape.stream_delta(0, piece, False)
        content, deltas = content + text, deltas + calls
    text, calls = shape.stream_delta(0, "", True)
    content, deltas = content + text, deltas + calls
    assert content == "ok "
    dumped = [d.model_dump() for d in deltas]
    assert dumped[0]["index"] == 0 and dumped[0]["type"] == "function" and dumped[0]["id"].startswith("call_")
    assert dumped[0]["function"] == {"name": "get_time", "arguments": ""}
    assert dumped[1] == {"index": 0, "function": {"arguments": "{}"}}
    assert dumped[2]["index"] == 1 and dumped[3]["function"] == {"arguments": '{"city": "Oslo"}'}
    assert shape.stream_finish_reason(0, "stop") == "tool_calls"


DEEP = "[" * 100_000 + "]" * 100_000  # Python's JSON parser recurses per level: this exhausts its stack


def test_replayed_arguments_nested_too_deeply_reach_the_template_as_sent():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})]
    tokenizer = _Template()
    chat_prompt_ids(tokenizer, messages, True, None)
    assert tokenizer.seen["conversation"][0]["tool_calls"][0]["function"]["arguments"] == DEEP


@pytest.mark.parametrize("fmt", [qwen.FORMAT, llama.FORMAT])
def test_model_output_nested_too_deeply_is_plain_content(fmt):
    inner = '{"name": "f", "arguments": ' + DEEP + "}"
    text = f"<tool_call>\n{inner}\n</tool_call>" if fmt is qwen.FORMAT else inner
    parsed = parse_output(fmt, text)
    assert parsed.calls == [] and parsed.content == text
    string_arguments = '{"name": "f", "parameters": ' + json.dumps(DEEP) + "}"  # arguments as a JSON string
    assert parse_output(llama.FORMAT, string_arguments).calls == []


class _Encoder(_Template):
    def encode(self, text, add_special_tokens=True):
        text.encode("utf-8")  # what a real tokenizer trips over (as a TypeError, deep inside)
        return [1]


def test_a_lone_surrogate_in_the_text_is_the_clients_error():
    lone = "a\ud800b"  # JSON may carry "\ud800", which Python keeps in a str
    with pytest.raises(ApiError) as prompt:
        completion_prompt_ids(_Encoder(), lone)
    assert prompt.value.status == 400 and prompt.value.param == "prompt" and "\\ud800" in prompt.value.message
    with pytest.raises(ApiError) as chat:
        chat_prompt_ids(_Surrogate(), [ChatMessage(role="user", content=lone)], True, None)
    assert chat.value.status == 400 and chat.value.param == "messages"
    with pytest.raises(ApiError):
        text_token_ids(_Encoder(), lone, add_special_tokens=True)
    assert completion_prompt_ids(_Encoder(), "a\U0001f600b") == [1]  # a pair written as one character is fine


class _Surrogate(_Encoder):
    def apply_chat_template(self, conversation, **kwargs):
        return conversation[0]["content"]


def test_a_json_schema_string_nested_too_deeply_is_a_400():
    request = CompletionRequest(model="m", prompt="x", structured_outputs={"json": DEEP})
    with pytest.raises(ApiError) as refused:
        structured_output(request)
    assert refused.value.status == 400 and "nested too deeply" in refused.value.message


def test_a_response_format_schema_nested_too_deeply_is_a_400():
    schema: dict[str, object] = {"type": "string"}
    for _ in range(5000):  # built in Python, past the recursion limit of json.dumps (the body parser stops sooner)
        schema = {"type": "array", "items": schema}
    request = CompletionRequest(
        model="m", prompt="x", response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    with pytest.raises(ApiError) as refused:
        structured_output(request)
    assert refused.value.status == 400 and refused.value.param == "response_format"
    assert "nested too deeply" in refused.value.message
