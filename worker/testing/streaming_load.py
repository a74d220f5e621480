"""A streaming load: concurrent greedy `/v1/completions` streams spread over a group's ranks, every chunk timed.

Each stream is bound to a rank; its URL is looked up when it starts (a replacement process has new ports). A stream
records the arrival time (time.monotonic) of every chunk, its text and finish reason, and how it ended. An end by a
broken connection (refused, reset, or cut mid-body: what a client of a killed rank sees) is a `CONNECTION` failure,
kept apart from the others (a timeout, an HTTP error status, an error event in the stream, or a body that ended
without a finish reason), because the acceptance counts the first as expected on a failed rank and the others as
requests lost.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import httpx


class StreamFailure(StrEnum):
    CONNECTION = "connection"  # refused, reset or cut: the rank's process is gone
    TIMEOUT = "timeout"  # no byte within the read timeout
    HTTP = "http"  # an error status before the stream began
    SERVER_ERROR = "server_error"  # an error event inside the stream
    INCOMPLETE = "incomplete"  # the body ended without a finish reason


@dataclass(frozen=True)
class StreamRequest:
    index: int
    rank: int
    prompt: str | list[int]
    max_tokens: int


@dataclass
class StreamRecord:
    request: StreamRequest
    url: str = ""
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # monotonic arrival of every chunk carrying text
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    ended_at: float | None = None
    failure: StreamFailure | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def completed(self) -> bool:
        return self.failure is None and self.finish_reason is not None

    @property
    def lost_connection(self) -> bool:
        return self.failure is StreamFailure.CONNECTION

    def longest_gap(self, after: float | None = None, before: float | None = None) -> float | None:
        """The longest time between two consecutive chunks, over the gaps that end after `after` and start before
        `before`; None when no gap does. So the gap a fault falls into counts after the fault, and a gap is never
        split between two windows that meet inside it: it counts in both."""
        return longest_gap(self.chunk_times, after, before)

    def first_chunk_after(self, t: float) -> float | None:
        return next((at for at in self.chunk_times if at > t), None)


def longest_gap(times: Sequence[float], after: float | None = None, before: float | None = None) -> float | None:
    gaps = [
        end - start
        for start, end in itertools.pairwise(times)
        if (after is None or end > after) and (before is None or start < before)
    ]
    return max(gaps, default=None)


def round_robin(prompts: Sequence[str | list[int]], ranks: Sequence[int], max_tokens: int) -> list[StreamRequest]:
    """One stream per prompt, the i-th on ranks[i % len(ranks)]."""
    return [StreamRequest(i, ranks[i % len(ranks)], prompt, max_tokens) for i, prompt in enumerate(prompts)]


class StreamingLoad:
    """`start()` launches every stream at once in the running event loop; `wait()` returns the records.

    `serving_url(rank)` gives the rank's serving API base URL when the stream starts. Requests are greedy
    (temperature 0) with `ignore_eos`, so each runs to exactly `max_tokens` and its text is reproducible. With
    `start(repeat=True)` each request is sent again as soon as it completes, until `stop_repeating()`, for a load
    that lasts through a whole recovery; a request that fails is not repeated (its rank may be gone). Records are
    kept in the order the requests were sent; `request.index` says which prompt each one carried."""

    def __init__(
        self,
        serving_url: Callable[[int], str],
        requests: Sequence[StreamRequest],
        model: str,
        *,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.serving_url = serving_url
        self.model = model
        self.requests = list(requests)
        self.records: list[StreamRecord] = []
        self._repeat = False
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=0),
        )
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, *, repeat: bool = False) -> StreamingLoad:
        if self._tasks:
            raise RuntimeError("this load was started already")
        self._repeat = repeat
        firsts = [StreamRecord(request) for request in self.requests]
        self.records.extend(firsts)
        self._tasks = [asyncio.create_task(self._keep_sending(record)) for record in firsts]
        return self

    def stop_repeating(self) -> None:
        """Requests in flight finish; none is sent again."""
        self._repeat = False

    async def wait_streaming(self, timeout_s: float = 60.0) -> None:
        """Until every stream has received a chunk or ended: the moment to inject a fault 'under load'."""
        deadline = time.monotonic() + timeout_s
        firsts = self.records[: len(self.requests)]
        while any(not r.chunk_times and r.ended_at is None for r in firsts):
            if time.monotonic() > deadline:
                waiting = [r.request.index for r in firsts if not r.chunk_times and r.ended_at is None]
                raise TimeoutError(f"streams {waiting} got no chunk within {timeout_s:g}s")
            await asyncio.sleep(0.01)

    async def wait(self, timeout_s: float = 300.0) -> list[StreamRecord]:
        """Every stream's record once all have ended (TimeoutError naming the ones still running)."""
        if not self._tasks:
            raise RuntimeError("start() the load first")
        done, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
        if pending:
            running = [r.request.index for r in self.records if r.ended_at is None]
            raise TimeoutError(f"streams {running} had not ended after {timeout_s:g}s")
        for task in done:
            task.result()  # a bug in the recorder itself surfaces here
        return self.records

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def __aenter__(self) -> StreamingLoad:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _keep_sending(self, record: StreamRecord) -> None:
        await self._run(record)
        while self._repeat and record.completed:
            record = StreamRecord(record.request)
            self.records.append(record)
            await self._run(record)

    async def _run(self, record: StreamRecord) -> None:
        request = record.request
        record.url = f"{self.serving_url(request.rank)}/v1/completions"
        body = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        record.sent_at = time.monotonic()
        try:
            async with self._client.stream("POST", record.url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    record.failure = StreamFailure.HTTP
                    record.error = f"{response.status_code}: {response.text[:300]}"
                    return
                async for line in response.aiter_lines():
                    if not _take_event(record, line):
                        break
            if record.failure is None and record.finish_reason is None:
                record.failure = StreamFailure.INCOMPLETE
                record.error = "the stream ended without a finish reason"
        except httpx.TimeoutException as exc:
            record.failure, record.error = StreamFailure.TIMEOUT, f"{type(exc).__name__}: {exc}"
        except httpx.TransportError as exc:
            record.failure, record.error = StreamFailure.CONNECTION, f"{type(exc).__name__}: {exc}"
        finally:
            record.ended_at = time.monotonic()


def _take_event(record: StreamRecord, line: str) -> bool:
    """Record one SSE line; False once the stream is over ([DONE] or an error event)."""
    if not line.startswith("data: "):
        return True
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        return False
    event = json.loads(data)
    if "error" in event:
        record.failure = StreamFailure.SERVER_ERROR
        record.error = str(event["error"].get("message", event["error"]))
        return False
    usage = event.get("usage")
    if usage:
        record.completion_tokens = usage.get("completion_tokens")
    for choice in event.get("choices", []):
        text = choice.get("text") or ""
        if text:
            record.chunk_times.append(time.monotonic())
            record.pieces.append(text)
        if choice.get("finish_reason") is not None:
            record.finish_reason = choice["finish_reason"]
    return True
