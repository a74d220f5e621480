"""Server-sent events: the chunk sequences of both endpoints, and a response that frees the request on every exit.

A streamed request ends in one of three ways: the engine finishes it; the client disconnects (Starlette cancels the
stream), which must abort the request at once to free its sequence; or the client stops reading. The engine never
waits on a client (outputs queue per request), so a stalled reader holds no KV-cache blocks past the request's own
end, but it would keep the connection and the queued text for as long as it likes. The response therefore bounds
every write by `write_timeout_s`, and calls the generation's synchronous `close()` in a `finally` on every exit (which
also gives back the request's admission slot).

Events are made on the event loop, which shares the GIL with the engine's step thread, so they are kept cheap: plain
token chunks come from sse_chunks.py instead of pydantic, and the outputs a stream already has queued (it fell behind
the engine) go out in one write.
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
    now_s,
)
from tidal.worker.server.send_watch import SendWatch
from tidal.worker.server.shaping import ChatShape, CompletionShape
from tidal.worker.server.sse_chunks import ChatEvents, CompletionEvents

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


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
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an SSE response must run in a task")
        cancelling = task.cancelling()
        watch = SendWatch(task, self._write_timeout_s)

        async def watched_send(message: Message) -> None:
            watch.write_started()
            await send(message)
            watch.write_done()

        try:
            await super().stream_response(watched_send)
        except asyncio.CancelledError:
            # Only our own cancel, with none from elsewhere on top, ends here; any other goes on.
            if not watch.fired or task.uncancel() > cancelling:
                raise
            # Ending here leaves the response incomplete; the server then closes the connection, which is the
            # only way left to tell a client that stopped reading.
            log.warning("abandoning a stream: client did not read a chunk within %gs", self._write_timeout_s)
        finally:
            watch.stop()


def _error_event(exc: BaseException) -> str:
    """The same body, code included, as the error would have had as a response before the stream started."""
    if isinstance(exc, ApiError):
        return sse_event(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    return sse_event(error_body(500, "internal error in the engine", code="internal_error"))


def _may_wait(choices: Choices) -> bool:
    """Whether events made so far may wait for the next output's: it is already here (the stream fell behind the
    engine, so one write carries several events), or the choices are done (the end follows at once)."""
    return choices.has_ready_output or choices.is_finished


async def completion_events(
    choices: Choices, response_id: str, model: str, include_usage: bool, shape: CompletionShape
) -> AsyncIterator[str]:
    """`text_completion` chunks: one per engine output with something new (text, logprobs, token ids; a choice's
    first also the echoed prompt), each choice's last with its finish reason; each carries one choice and its index.
    Each item yielded is one write of one or more events."""
    created = now_s()  # the same in every chunk of a stream, as OpenAI's
    plain = CompletionEvents(response_id, model, created) if shape.is_plain else None
    started: set[int] = set()  # plain: choices that sent a chunk (a choice's first is sent even without text)
    batch: list[str] = []
    try:
        async for index, output in choices.outputs():
            if plain is not None:
                if output.new_text or output.finish_reason is not None or index not in started:
                    started.add(index)
                    batch.append(plain.text(index, output.new_text, output.finish_reason))
            else:
                choice = shape.chunk(index, choices.generation_of(index), output)
                if choice is not None:
                    chunk = CompletionResponse(id=response_id, created=created, model=model, choices=[choice])
                    batch.append(sse_event(chunk))
            if batch and not _may_wait(choices):
                yield "".join(batch)
                batch.clear()
    except Exception as exc:  # the stream has started (status 200), so the error can only travel as an event
        yield "".join([*batch, _error_event(exc)])
        return
    if include_usage:
        completion_tokens = 0 if shape.scores_only else choices.num_output_tokens
        usage = Usage.of(choices.num_prompt_tokens, completion_tokens)
        batch.append(
            sse_event(CompletionResponse(id=response_id, created=created, model=model, choices=[], usage=usage))
        )
    yield "".join([*batch, DONE])


async def chat_events(
    choices: Choices, response_id: str, model: str, include_usage: bool, shape: ChatShape
) -> AsyncIterator[str]:
    """`chat.completion.chunk`s, for each choice: the role first (with the prompt's token ids and logprobs, if asked),
    then content deltas (with their tokens' logprobs and ids, if asked) and tool-call deltas, then an empty delta with
    the finish reason; each chunk carries one choice, with its index. Each item yielded is one write of one or more
    events."""
    created = now_s()  # the same in every chunk of a stream, as OpenAI's
    plain = ChatEvents(response_id, model, created) if shape.is_plain else None

    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None, **extra: object) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason, **extra)  # type: ignore[arg-type]
        return sse_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice]))

    batch: list[str] = []  # the role chunks go out with the first output's, which is already here
    for index in range(choices.num_choices):
        choice = ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        generation = choices.generation_of(index)
        prompt_ids, prompt_lp = shape.token_ids(generation.prompt_token_ids), shape.prompt_logprobs(generation)
        role = ChatCompletionChunk(
            id=response_id, created=created, model=model, choices=[choice], prompt_token_ids=prompt_ids,
            prompt_logprobs=prompt_lp,
        )  # fmt: skip
        batch.append(sse_event(role))
    try:
        async for index, output in choices.outputs():
            if plain is not None:
                if output.new_text:
                    batch.append(plain.content(index, output.new_text))
                if output.finish_reason is not None:
                    batch.append(plain.finish(index, output.finish_reason))
            else:
                logprobs = shape.logprobs(output.logprobs) if output.logprobs else None
                token_ids = shape.token_ids(output.new_token_ids) if output.new_token_ids else None
                finished = output.finish_reason is not None
                # With tools, text that may start a call is held back; calls go out whole, as their own deltas.
                content, calls = shape.stream_delta(index, output.new_text, finished)
                if content or logprobs or token_ids:
                    batch.append(chunk(index, ChatDelta(content=content), logprobs=logprobs, token_ids=token_ids))
                for call in calls:
                    batch.append(chunk(index, ChatDelta(tool_calls=[call])))
                if output.finish_reason is not None:
                    batch.append(chunk(index, ChatDelta(), shape.stream_finish_reason(index, output.finish_reason)))
            if batch and not _may_wait(choices):
                yield "".join(batch)
                batch.clear()
    except Exception as exc:  # see completion_events
        yield "".join([*batch, _error_event(exc)])
        return
    if include_usage:
        usage = Usage.of(choices.num_prompt_tokens, choices.num_output_tokens)
        batch.append(
            sse_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage))
        )
    yield "".join([*batch, DONE])
