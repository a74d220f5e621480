"""Tool calling through the official `openai` client (sync and async, streamed and not) against the real server and
engine on tiny random models, CPU. A random model never decides to call a tool, so the wire format is proven with
`required` and a named tool_choice, which a grammar forces into each family's format: Qwen2 (`<tool_call>` tags),
Llama (JSON objects), and Llama served with the Mistral format named by the operator (`tool_call_parser`). What
`auto` reads out of free text is tested on the parsers themselves (tests/unit/worker/test_tool_call_*.py)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tidal.worker.testing.in_process import serving_worker

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
# Enums and booleans only: a random model's arguments then always end within a few tokens.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module", params=[("qwen2", "auto"), ("llama", "auto"), ("llama", "mistral")], ids=str)
def worker_url(request, tiny_model):
    arch, parser = request.param
    # The tools written into the prompt take a few hundred of the tiny tokenizer's tokens.
    with serving_worker(tiny_model(arch), MODEL, tool_call_parser=parser, max_model_len=1024) as servers:
        yield servers.url()


def _check_call(call, names=tuple(SCHEMAS)):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_one_call_of_a_listed_tool(client):
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_with_parallel_calls_gives_at_least_one(client, seed):
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=400, seed=seed
    )
    choice = result.choices[0]
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _check_call(call)
    assert choice.finish_reason in ("tool_calls", "length")


def _accumulate(chunks):
    """The calls and content of a streamed choice, put together as a client does."""
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_streamed_named_call_equals_the_whole_one(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 300}
    whole = client.chat.completions.create(**kwargs, temperature=0).choices[0]
    content, calls, finish = _accumulate(client.chat.completions.create(**kwargs, temperature=0, stream=True))
    assert whole.finish_reason == finish == "tool_calls"
    assert content == "" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_time"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_async_named_and_required_calls(async_client):
    async def run():
        named = async_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=300, seed=3
        )
        streamed = await async_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=300, stream=True, seed=4,
        )  # fmt: skip
        chunks = [chunk async for chunk in streamed]
        return await named, chunks

    named, chunks = asyncio.run(run())
    assert named.choices[0].finish_reason == "tool_calls"
    _check_call(named.choices[0].message.tool_calls[0], ("get_time",))
    content, calls, finish = _accumulate(chunks)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] in SCHEMAS
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_auto_puts_the_tools_in_the_prompt_and_none_leaves_them_out(client):
    def prompt_length(**kwargs):
        result = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"return_token_ids": True}, **kwargs
        )
        assert result.choices[0].finish_reason in ("stop", "length")
        return len(result.model_extra["prompt_token_ids"])

    plain = prompt_length()
    assert prompt_length(tools=TOOLS) > plain
    assert prompt_length(tools=TOOLS, tool_choice="none") == plain


def test_a_conversation_replaying_a_call_and_its_result(client):
    first = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=300)
        .choices[0]
        .message
    )
    messages = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "12:00"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "must be unique"),
        # A call's arguments are an object: forced to be an array, the call came back as plain text.
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                "tool_choice": "required",
            },
            "parameters must be a JSON schema of type object",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
    ],
)
def test_requests_that_cannot_work_are_400s(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_tools(client):
    bad = [
        {
            "type": "function",
            "function": {"name": "broken", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}},
        }
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=bad, tool_choice="required")
    error = caught.value.body
    assert error["code"] == "invalid_grammar"
    assert error["param"] == "tools"


def test_a_tool_schema_too_costly_to_compile_is_a_400_naming_tools(client):
    """Refused before compiling (schema_cost.py): 50 email formats are most of a second of the compiler's time."""
    emails = {f"e{i}": {"type": "string", "format": "email"} for i in range(50)}
    costly = [
        {"type": "function", "function": {"name": "mail", "parameters": {"type": "object", "properties": emails}}}
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, tools=costly, tool_choice="required"
        )
    error = caught.value.body
    assert "the tools' parameters would take too long to compile" in error["message"]
    assert "the format email of parameters 1#/properties/e" in error["message"]
    assert error["param"] == "tools"
