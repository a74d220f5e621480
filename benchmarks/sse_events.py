"""The event loop's cost of streaming tokens, on the CPU: per SSE event, and per engine step for N streams.

    python benchmarks/sse_events.py [--streams 64] [--steps 400] [--behind 4]

1. Per event: one plain token chunk (choice index, text, no finish reason) made as a pydantic model and serialized
   (what every event cost before sse_chunks.py), against the same bytes from sse_chunks.py; both endpoints.
2. Per step: N streaming completion requests run the server's real path — Generation, Choices,
   `completion_events`, the SSE response with its bounded writes — over a fake engine whose streams are asyncio
   queues fed as AsyncEngine's `_put_all` feeds them (one call per step putting one output in every queue). A step
   is timed from that call until every stream has handed its events to `send` (an ASGI send that only counts: no
   HTTP framing, no socket). "behind" puts `--behind` steps' outputs at once, as when the loop fell behind the
   engine: each stream then writes them in one go. Both with the pydantic chunks and with the fast events.

The loop-side time is what the engine's step thread waits on the GIL for; it adds to a step's time once the loop's
share of the GIL nears the step's own time (e.g. 64 streams at ~5 ms a step on an H200).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from tidal.worker.engine.outputs import RequestOutput
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.choices import Choices
from tidal.worker.server.generation import Generation
from tidal.worker.server.protocol import CompletionRequest
from tidal.worker.server.responses import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
)
from tidal.worker.server.shaping import CompletionShape
from tidal.worker.server.sse_chunks import ChatEvents, CompletionEvents
from tidal.worker.server.streaming import SSEResponse, completion_events, sse_event
from tidal.worker.server.token_info import TokenTexts

TEXT = " token"
SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


def per_event_us(number: int) -> dict[str, float]:
    """µs to make one plain token event, each way."""
    rid, model, created = "cmpl-3f2a9c0d4b5e6f708192a3b4c5d6e7f8", "meta-llama/Llama-3.1-8B-Instruct", 1733097600
    completion, chat = CompletionEvents(rid, model, created), ChatEvents(rid, model, created)

    def pydantic_completion() -> str:
        choice = CompletionChoice(index=0, text=TEXT, finish_reason=None)
        return sse_event(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))

    def pydantic_chat() -> str:
        choice = ChatStreamChoice(index=0, delta=ChatDelta(content=TEXT), finish_reason=None)
        return sse_event(ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))

    cases: dict[str, Callable[[], str]] = {
        "completion pydantic": pydantic_completion,
        "completion fast": lambda: completion.text(0, TEXT, None),
        "chat pydantic": pydantic_chat,
        "chat fast": lambda: chat.content(0, TEXT),
    }
    return {name: min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6 for name, fn in cases.items()}


class _FakeEngine:
    """AsyncEngine's side of a stream as the server sees it: an asyncio queue per request, read by an async
    generator that ends with the finish reason."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def generate(self, request_id: str, prompt: list[int], params: Any, n: int = 1) -> AsyncIterator[RequestOutput]:
        queue = self.queues[request_id] = asyncio.Queue()

        async def stream() -> AsyncIterator[RequestOutput]:
            while True:
                item = await queue.get()
                yield item
                if item.finish_reason is not None:
                    return

        return stream()

    def has_ready_output(self, request_id: str) -> bool:
        return not self.queues[request_id].empty()

    def abort(self, request_id: str) -> None:
        pass


async def _streams_run(num_streams: int, num_steps: int, behind: int, fast: bool) -> float:
    """µs of loop time per engine step (one output per stream)."""
    engine = _FakeEngine()
    metrics = WorkerMetrics(CollectorRegistry(), lambda: None)
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True})
    shape = CompletionShape(request, ["hi"], TokenTexts(None))
    if not fast:  # the same request through the pydantic chunks, as every plain one went before
        shape = _PydanticShape(request, ["hi"], TokenTexts(None))
    events = 0  # sent so far (a write may carry several)
    written = asyncio.Event()
    target = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal events
        body = message.get("body")
        if body:
            events += body.count(b"data: ")
            if events >= target:
                written.set()

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    responses = []
    for s in range(num_streams):
        generation = Generation(engine, metrics, "completions", f"r{s}", [1, 2, 3], None)  # type: ignore[arg-type]
        queue = engine.queues[f"r{s}"]
        queue.put_nowait(RequestOutput(f"r{s}", [5], TEXT, None, 3, 1))
        await generation.start()
        choices = Choices([generation], 1)
        stream = completion_events(choices, f"cmpl-{s}", "m", False, shape)
        responses.append(asyncio.create_task(SSEResponse(stream, choices.close, 30.0)(SCOPE, receive, send)))
    queues = list(engine.queues.values())
    target = num_streams  # each stream's first event (the headers are not a body)
    await written.wait()
    start = time.perf_counter()
    for step in range(0, num_steps, behind):
        written.clear()
        target = events + num_streams * behind
        for _ in range(behind):  # one _put_all per engine step, `behind` of them before the loop gets its turn
            for s, queue in enumerate(queues):
                queue.put_nowait(RequestOutput(f"r{s}", [5], TEXT, None, 3, step))
        await written.wait()
    elapsed = time.perf_counter() - start
    for s, queue in enumerate(queues):
        queue.put_nowait(RequestOutput(f"r{s}", [], "", "length", 3, num_steps))
    await asyncio.gather(*responses)
    return elapsed / num_steps * 1e6


class _PydanticShape(CompletionShape):
    @property
    def is_plain(self) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--behind", type=int, default=4, help="steps queued at once in the 'behind' rows")
    parser.add_argument("--events", type=int, default=20000, help="events per timing of the per-event rows")
    parser.add_argument("--repeat", type=int, default=5, help="runs per row; the fastest counts (shared CPUs)")
    args = parser.parse_args()
    print("| one plain token event | µs |\n| --- | ---: |")
    for name, us in per_event_us(args.events).items():
        print(f"| {name} | {us:.2f} |")
    print(f"\n| loop time, {args.streams} streams, completions | µs / step | µs / event |\n| --- | ---: | ---: |")
    for behind in (1, args.behind):
        for fast in (False, True):
            us = min(asyncio.run(_streams_run(args.streams, args.steps, behind, fast)) for _ in range(args.repeat))
            name = f"{'fast' if fast else 'pydantic'}, " + ("in step" if behind == 1 else f"{behind} steps behind")
            print(f"| {name} | {us:.0f} | {us / args.streams:.2f} |")


if __name__ == "__main__":
    main()
