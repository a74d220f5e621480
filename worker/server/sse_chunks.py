"""The per-token SSE events of a stream, written without pydantic: the bytes a chunk model would give, for a fraction
of the cost.

At 64 streams a worker sends ~12,000 events a second from the event loop, which shares the GIL with the engine's
step thread; building a pydantic model per event and serializing it was most of an event's cost. Within one stream
only a chunk's choice index, text and finish reason vary (`id`, `object`, `created` and `model` are the stream's), so
the fixed parts are made once and the variable strings go through the stdlib's C string encoder.

The fast events cover the plain chunks only: text and finish reason, no logprobs, token ids, echo or usage; every
other chunk stays a pydantic model (streaming.py picks). The output equals `model_dump_json()` of the same chunk
byte for byte (tests/unit/worker/test_sse_chunks.py): both leave non-ASCII characters as UTF-8 (U+2028 included) and
escape `"`, `\\` and the C0 controls alike.
"""

from __future__ import annotations

import json

# ensure_ascii off: pydantic writes non-ASCII characters as they are, so must this. A str goes straight to the C
# function that escapes one string, without json.dumps's per-call setup.
_encode_str = json.JSONEncoder(ensure_ascii=False).encode


def json_str(value: str) -> str:
    """`value` as a JSON string literal, quotes included, escaped as pydantic escapes it."""
    return _encode_str(value)


class _Stream:
    """What every chunk of one stream starts with, up to its choice's index; one per request."""

    def __init__(self, object_name: str, response_id: str, model: str, created: int) -> None:
        self._head = (
            f'data: {{"id":{json_str(response_id)},"object":"{object_name}","created":{created},'
            f'"model":{json_str(model)},"choices":[{{"index":'
        )
        self._heads: list[str] = []  # by choice index, made on first use

    def head(self, index: int) -> str:
        heads = self._heads
        while len(heads) <= index:
            heads.append(f"{self._head}{len(heads)}")
        return heads[index]


def _finish(reason: str | None) -> str:
    return "null" if reason is None else json_str(reason)


class CompletionEvents(_Stream):
    """`text_completion` chunks of one choice's text and/or finish reason."""

    def __init__(self, response_id: str, model: str, created: int) -> None:
        super().__init__("text_completion", response_id, model, created)

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        return (
            f'{self.head(index)},"text":{_encode_str(text)},"logprobs":null,'
            f'"finish_reason":{_finish(finish_reason)}}}],"usage":null}}\n\n'
        )


class ChatEvents(_Stream):
    """`chat.completion.chunk`s of a content delta, and of a choice's end (an empty delta with the reason)."""

    def __init__(self, response_id: str, model: str, created: int) -> None:
        super().__init__("chat.completion.chunk", response_id, model, created)

    def content(self, index: int, text: str) -> str:
        return (
            f'{self.head(index)},"delta":{{"content":{_encode_str(text)}}},"logprobs":null,'
            '"finish_reason":null}],"usage":null}\n\n'
        )

    def finish(self, index: int, finish_reason: str) -> str:
        return (
            f'{self.head(index)},"delta":{{}},"logprobs":null,'
            f'"finish_reason":{json_str(finish_reason)}}}],"usage":null}}\n\n'
        )
