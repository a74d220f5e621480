"""One reconcile at a time per model, coalesced, with a timer that brings each model back.

Many triggers (the model changed, any of its pods changed, the timer) ask for the same level-based pass. While a
pass runs, at most one more waits; further requests are dropped because the waiting pass will read the world after
them anyway. After each pass the reconcile function says when to come back (soon after acting, `resync` otherwise);
that timer is the periodic resync, and keeping it here (not as a kopf timer) means no finalizer on the models.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("tidal.operator.queue")

Key = tuple[str, str]  # (namespace, name)
# (key, when the pass was first asked for, time.monotonic) -> seconds until the next pass; None: never
ReconcileFn = Callable[[Key, float], Awaitable[float | None]]


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: bool = False
    # When the waiting pass was first asked for (a pod's event, a timer): what "observed" means for the failures it
    # finds, so a pass that waited behind another one still counts from the event.
    asked_at: float | None = None
    timer: asyncio.TimerHandle | None = None
    due: float = 0.0
    forgotten: bool = False  # forget() came during a pass: that pass schedules nothing


class ReconcileQueue:
    def __init__(self, reconcile: ReconcileFn) -> None:
        self._reconcile = reconcile
        self._entries: dict[Key, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def request(self, key: Key) -> None:
        """Run a pass for `key` now, or after the one in progress; returns when that pass is done (or coalesced)."""
        entry = self._entries.setdefault(key, _Entry())
        if entry.waiting:
            return
        entry.waiting = True
        entry.asked_at = time.monotonic()
        async with entry.lock:
            entry.waiting = False
            entry.forgotten = False  # a pass that starts now reads the world after the forget
            asked_at, entry.asked_at = entry.asked_at, None
            delay = await self._reconcile(key, asked_at if asked_at is not None else time.monotonic())
            if not entry.forgotten:
                self.schedule(key, delay)
            elif not entry.waiting and self._entries.get(key) is entry:
                del self._entries[key]

    def schedule(self, key: Key, delay: float | None) -> None:
        """Come back to `key` after `delay` seconds; an earlier timer already set wins."""
        entry = self._entries.get(key)
        if entry is None:
            return
        loop = asyncio.get_running_loop()
        if delay is None:
            self._cancel(entry)
            return
        due = loop.time() + delay
        if entry.timer is not None and not entry.timer.cancelled() and entry.due <= due:
            return
        self._cancel(entry)
        entry.due = due
        entry.timer = loop.call_later(delay, self._fire, key)

    def _fire(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.timer = None
        task = asyncio.get_running_loop().create_task(self.request(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _cancel(entry: _Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def forget(self, key: Key) -> None:
        """The model is gone: no more timers for it.

        An entry whose pass is running stays (marked), so that a request arriving meanwhile (the model re-created,
        a pod event) waits on the same lock instead of starting a second pass beside the running one.
        """
        entry = self._entries.get(key)
        if entry is None:
            return
        self._cancel(entry)
        if entry.lock.locked() or entry.waiting:
            entry.forgotten = True
        else:
            del self._entries[key]

    def keys(self) -> list[Key]:
        return list(self._entries)

    async def close(self) -> None:
        for entry in self._entries.values():
            self._cancel(entry)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
