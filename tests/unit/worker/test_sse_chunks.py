"""The fast SSE events are the pydantic chunks' bytes exactly (compared as bytes, not as parsed JSON), for both
endpoints, every choice index, finish reason and escape-heavy text; and the streams pick them only for plain
requests."""

from __future__ import annotations

import json

import pytest

from tidal.worker.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.worker.server.responses import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
)
from tidal.worker.server.shaping import ChatShape, CompletionShape
from tidal.worker.server.sse_chunks import ChatEvents, CompletionEvents
from tidal.worker.server.streaming import sse_event
from tidal.worker.server.token_info import TokenTexts

TEXTS = [
    "",
    "hello",
    " world",
    'quote " and backslash \\ and slash /',
    "".join(chr(c) for c in range(0x20)) + "\x7f",  # every C0 control, DEL
    "\u0080\u009f\u00a0é",  # C1 controls, NBSP
    "line\u2028separator\u2029paragraph",  # JSON allows these raw; JavaScript once did not
    "\ufeff\ufffd\U0001f600 日本語 ",
    "\\u0041 not an escape",
    "tab\tnew\nline\rcr\x08bs\x0cff",
]
IDS = ["cmpl-0123abcd", 'id with "quote" and \u2028']
MODELS = ["tiny", "org/Model-8B", "modèle \\ \u2028"]
REASONS = [None, "stop", "length", "abort"]


@pytest.mark.parametrize("response_id", IDS)
@pytest.mark.parametrize("model", MODELS)
def test_completion_events_equal_the_pydantic_chunks_byte_for_byte(response_id, model):
    events = CompletionEvents(response_id, model, created=1733097600)
    for index in (0, 1, 7, 12):
        for text in TEXTS:
            for reason in REASONS:
                choice = CompletionChoice(index=index, text=text, finish_reason=reason)
                chunk = CompletionResponse(id=response_id, created=1733097600, model=model, choices=[choice])
                assert events.text(index, text, reason).encode() == sse_event(chunk).encode()


@pytest.mark.parametrize("response_id", IDS)
@pytest.mark.parametrize("model", MODELS)
def test_chat_events_equal_the_pydantic_chunks_byte_for_byte(response_id, model):
    events = ChatEvents(response_id, model, created=5)

    def pydantic(index: int, delta: ChatDelta, reason: str | None = None) -> bytes:
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=reason)  # type: ignore[arg-type]
        return sse_event(ChatCompletionChunk(id=response_id, created=5, model=model, choices=[choice])).encode()

    for index in (0, 3, 10):
        for text in TEXTS:
            assert events.content(index, text).encode() == pydantic(index, ChatDelta(content=text))
        for reason in REASONS[1:]:
            assert events.finish(index, reason).encode() == pydantic(index, ChatDelta(), reason)


def test_every_event_is_one_sse_data_line_of_valid_json():
    event = ChatEvents("c", "m", 1).content(2, "a\nb\u2028c")
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
    assert json.loads(event[len("data: ") :])["choices"][0] == {
        "index": 2,
        "delta": {"content": "a\nb\u2028c"},
        "logprobs": None,
        "finish_reason": None,
    }


def test_choice_indices_may_come_in_any_order():
    events = CompletionEvents("i", "m", 1)
    assert '"index":9,' in events.text(9, "x", None)
    assert '"index":2,' in events.text(2, "x", None)


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ({}, True),
        ({"n": 3, "stream_options": {"include_usage": True}}, True),  # usage is its own (pydantic) chunk
        ({"logprobs": 2}, False),
        ({"echo": True}, False),
        ({"echo": True, "max_tokens": 0}, False),
        ({"prompt_logprobs": 1}, False),
        ({"return_token_ids": True}, False),
    ],
)
def test_completion_streams_take_the_fast_events_only_when_plain(fields, plain):
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True, **fields})
    assert CompletionShape(request, ["hi"], TokenTexts(None)).is_plain is plain  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ({}, True),
        ({"n": 2, "stream_options": {"include_usage": True}}, True),
        ({"logprobs": True}, False),
        ({"logprobs": True, "top_logprobs": 2}, False),
        ({"return_token_ids": True}, False),
    ],
)
def test_chat_streams_take_the_fast_events_only_when_plain(fields, plain):
    messages = [{"role": "user", "content": "hi"}]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "stream": True, **fields})
    assert ChatShape(request, TokenTexts(None)).is_plain is plain  # type: ignore[arg-type]
