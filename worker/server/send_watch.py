"""A deadline on each write of a stream, for one timer per stream per deadline rather than one per write.

`asyncio.timeout` around every write schedules and cancels a timer handle per event: with 64 streams that is
~12,000 heap pushes a second on the event loop, about a quarter of its time per event (benchmarks/sse_events.py).
Writes almost always finish at once (the transport buffers them), so this watch only notes when a write starts and
ends, and one timer per stream looks in: at most every `timeout_s`, and exactly at the deadline of a write it saw in
flight. A write still in flight at its deadline cancels the stream's task, as `asyncio.timeout` would.
"""

from __future__ import annotations

import asyncio


class SendWatch:
    def __init__(self, task: asyncio.Task[object], timeout_s: float) -> None:
        self._task = task
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._started_at: float | None = None  # the write in flight, if any: when it began
        self._num_writes = 0  # told apart writes that began at the same loop time
        self.fired = False
        self._timer = self._loop.call_later(timeout_s, self._look)

    def write_started(self) -> None:
        self._started_at = self._loop.time()
        self._num_writes += 1

    def write_done(self) -> None:
        self._started_at = None

    def stop(self) -> None:
        self._timer.cancel()

    def _look(self) -> None:
        started_at = self._started_at
        if started_at is None:  # a write starting from now on ends its time no sooner than the next look
            self._timer = self._loop.call_later(self._timeout_s, self._look)
            return
        deadline = started_at + self._timeout_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check, self._num_writes)
            return
        self._fire()

    def _check(self, num_writes: int) -> None:
        """At the deadline of write `num_writes`: still that write -> too slow; else look again."""
        if self._started_at is not None and self._num_writes == num_writes:
            self._fire()
        else:
            self._look()

    def _fire(self) -> None:
        self.fired = True
        self._task.cancel()
