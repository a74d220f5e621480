"""Whole SSE streams: the fast events give the same stream as the pydantic chunks (byte for byte), and a stream that
fell behind the engine writes every output already there in one go, never holding one back to wait for the next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tidal.worker.engine.outputs import RequestOutput
from tidal.worker.server import streaming
from tidal.worker.server.errors import ApiError
from tidal.worker.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.worker.server.shaping import ChatShape, CompletionShape
from tidal.worker.server.token_info import TokenTexts


@dataclass
class _Generation:
    prompt_token_ids: list[int]
    prompt_logprobs: None = None


class FakeChoices:
    """Outputs that arrive in bursts: `bursts[i]` all at once (as one engine step's, or several steps' a stream
    fell behind on), the next burst only after the reader waited."""

    def __init__(self, bursts: list[list[tuple[int, RequestOutput] | BaseException]], n: int = 1) -> None:
        self.bursts = bursts
        self.num_choices = n
        self._ready = 0  # outputs of the current burst not read yet
        self._left = sum(1 for burst in bursts for item in burst if not isinstance(item, BaseException))
        self.waits = 0

    num_prompt_tokens = 3
    num_output_tokens = 5

    def generation_of(self, index: int) -> _Generation:
        return _Generation([1, 2, 3])

    @property
    def has_ready_output(self) -> bool:
        return self._ready > 0

    @property
    def is_finished(self) -> bool:
        return self._left == 0

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for burst in self.bursts:
            await asyncio.sleep(0)
            self.waits += 1
            self._ready = len(burst)
            for item in burst:
                self._ready -= 1
                if isinstance(item, BaseException):
                    raise item
                self._left -= 1
                yield item


def out(index: int, text: str, reason: str | None = None) -> tuple[int, RequestOutput]:
    return index, RequestOutput("r", [7] if text else [], text, reason, 3, 1, index)  # type: ignore[arg-type]


BURSTS = [
    [out(0, ""), out(1, "Hé")],
    [out(0, "llo\u2028"), out(1, '"q"')],
    [out(0, ""), out(0, " x"), out(1, "\\")],  # fell behind: several outputs of one choice at once
    [out(0, "", "stop"), out(1, "!", "length")],
]


def _run(events: AsyncIterator[str]) -> list[str]:
    async def collect() -> list[str]:
        return [item async for item in events]

    return asyncio.run(collect())


def _completion(fields: dict, plain: bool, bursts: list, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True, "n": 2, **fields})
    shape = CompletionShape(request, ["hi"], TokenTexts(None))
    monkeypatch.setattr(CompletionShape, "is_plain", property(lambda _: plain))
    include_usage = bool(fields.get("stream_options"))
    return _run(streaming.completion_events(FakeChoices(bursts, 2), "cmpl-1", "m", include_usage, shape))  # type: ignore[arg-type]


def _chat(fields: dict, plain: bool, bursts: list, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2, **fields}
    shape = ChatShape(ChatCompletionRequest.model_validate(body), TokenTexts(None))
    monkeypatch.setattr(ChatShape, "is_plain", property(lambda _: plain))
    include_usage = bool(fields.get("stream_options"))
    return _run(streaming.chat_events(FakeChoices(bursts, 2), "chat-1", "m", include_usage, shape))  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [_completion, _chat])
@pytest.mark.parametrize("fields", [{}, {"stream_options": {"include_usage": True}}])
def test_fast_and_pydantic_streams_are_the_same_bytes(make, fields, monkeypatch):
    monkeypatch.setattr(streaming, "now_s", lambda: 1700000000)
    fast = make(fields, True, BURSTS, monkeypatch)
    slow = make(fields, False, BURSTS, monkeypatch)
    assert "".join(fast).encode() == "".join(slow).encode()
    assert fast == slow  # and written in the same pieces
    assert "".join(fast).endswith(streaming.DONE)


def test_a_write_per_burst_and_the_last_one_with_the_end(monkeypatch):
    writes = _completion({}, True, BURSTS, monkeypatch)
    # One write per burst; the last burst finishes every choice, so [DONE] goes out with it.
    assert len(writes) == len(BURSTS)
    assert writes[2].count("data: ") == 2 and writes[-1].endswith(streaming.DONE)
    assert writes[0].count("data: ") == 2  # each choice's first chunk, the empty one too (not a later empty one)


def test_the_chat_role_chunks_go_out_with_the_first_output():
    monkeypatch = pytest.MonkeyPatch()
    writes = _chat({}, True, BURSTS, monkeypatch)
    monkeypatch.undo()
    assert writes[0].count('"role":"assistant"') == 2 and '"content":"Hé"' in writes[0]


def test_an_error_goes_out_after_the_events_before_it(monkeypatch):
    failing = [BURSTS[0], [out(0, "a"), ApiError(503, "going to sleep", code="interrupted")]]
    writes = _completion({}, True, failing, monkeypatch)
    assert '"text":"a"' in writes[-1] and '"code":"interrupted"' in writes[-1]
    assert not writes[-1].endswith(streaming.DONE)
