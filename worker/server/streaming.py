"""Server-sent events: the chunk sequences of both endpoints, and a response that frees the request on every exit.

A streamed request ends in one of three ways: the engine finishes it; the client disconnects (Starlette cancels the
stream), which must abort the request at once to free its sequence; or the client stops reading. The engine never
waits on a client (outputs queue per request), so a stalled reader holds no KV-cache blocks past the request's own
end, but it would keep the connection and the queued text for as long as it likes. The response therefore bounds
every write by `write_timeout_s`, and calls the generation's synchronous `close()` in a `finally` on every exit (which
also gives back the request's admission slot).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from tidal.worker.server.choices import Choices
from tidal.worker.server.errors import ApiError, error_body
from tidal.worker.server.responses import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionResponse,
    Usage,
)
from tidal.worker.server.shaping import ChatShape, CompletionShape

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class SlowClientError(Exception):
    """The client did not accept a chunk within the write timeout."""


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], write_timeout_s: float) -> None:
        # Proxies must not buffer or transform the stream, or tokens arrive in lumps.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers)
        self._on_close = on_close
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Here rather than in stream_response: Starlette runs that as a task of its own, and a client that is gone
        # before the task's first step cancels it before its body (and any `finally` in it) ever runs.
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self._write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowClientError(f"client did not read a chunk within {self._write_timeout_s:g}s") from None

        try:
            await super().stream_response(bounded_send)
        except SlowClientError as exc:
            # Ending here leaves the response incomplete; the server then closes the connection, which is the
            # only way left to tell a client that stopped reading.
            log.warning("abandoning a stream: %s", exc)


def _error_event(exc: BaseException) -> str:
    """The same body, code included, as the error would have had as a response before the stream started."""
    if isinstance(exc, ApiError):
        return sse_event(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    return sse_event(error_body(500, "internal error in the engine", code="internal_error"))


async def completion_events(
    choices: Choices, response_id: str, model: str, include_usage: bool, shape: CompletionShape
) -> AsyncIterator[str]:
    """`text_completion` chunks: one per engine output with something new (text, logprobs, token ids; a choice's
    first also the echoed prompt), each choice's last with its finish reason; each carries one choice and its index."""
    try:
        async for index, output in choices.outputs():
            choice = shape.chunk(index, choices.generation_of(index), output)
            if choice is not None:
                yield sse_event(CompletionResponse(id=response_id, model=model, choices=[choice]))
    except Exception as exc:  # the stream has started (status 200), so the error can only travel as an event
        yield _error_event(exc)
        return
    if include_usage:
        completion_tokens = 0 if shape.scores_only else choices.num_output_tokens
        usage = Usage.of(choices.num_prompt_tokens, completion_tokens)
        yield sse_event(CompletionResponse(id=response_id, model=model, choices=[], usage=usage))
    yield DONE


async def chat_events(
    choices: Choices, response_id: str, model: str, include_usage: bool, shape: ChatShape
) -> AsyncIterator[str]:
    """`chat.completion.chunk`s, for each choice: the role first (with the prompt's token ids and logprobs, if asked),
    then content deltas (with their tokens' logprobs and ids, if asked) and tool-call deltas, then an empty delta with
    the finish reason; each chunk carries one choice, with its index."""

    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, **extra: object) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason, **extra)  # type: ignore[arg-type]
        return sse_event(ChatCompletionChunk(id=response_id, model=model, choices=[choice]))

    for index in range(choices.num_choices):
        choice = ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        generation = choices.generation_of(index)
        prompt_ids, prompt_lp = shape.token_ids(generation.prompt_token_ids), shape.prompt_logprobs(generation)
        first = ChatCompletionChunk(
            id=response_id, model=model, choices=[choice], prompt_token_ids=prompt_ids, prompt_logprobs=prompt_lp
        )
        yield sse_event(first)
    try:
        async for index, output in choices.outputs():
            logprobs = shape.logprobs(output.logprobs) if output.logprobs else None
            token_ids = shape.token_ids(output.new_token_ids) if output.new_token_ids else None
            finished = output.finish_reason is not None
            # With tools, text that may start a call is held back; calls go out whole, as their own deltas.
            content, calls = shape.stream_delta(index, output.new_text, finished)
            if content or logprobs or token_ids:
                yield chunk(index, ChatDelta(content=content), logprobs=logprobs, token_ids=token_ids)
            for call in calls:
                yield chunk(index, ChatDelta(tool_calls=[call]))
            if output.finish_reason is not None:
                yield chunk(index, ChatDelta(), shape.stream_finish_reason(index, output.finish_reason))
    except Exception as exc:  # see completion_events
        yield _error_event(exc)
        return
    if include_usage:
        usage = Usage.of(choices.num_prompt_tokens, choices.num_output_tokens)
        yield sse_event(ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage))
    yield DONE
