"""How many generation requests the serving API holds at once: a bound, and a 429 with Retry-After beyond it.

The engine queues whatever it is given, and each request also holds a connection, its prompt and (while it waits for
a tokenizer thread) a place in that pool's queue; without a bound a burst grows all of them without limit and every
request's latency with them. A request takes a slot before its prompt is built and gives it back when it ends, however
it ends (`Slot.release` is idempotent, so every exit path may call it).
"""

from __future__ import annotations

from tidal.worker.server.errors import ApiError


class Slot:
    def __init__(self, slots: RequestSlots) -> None:
        self._slots = slots
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.in_use -= 1


class RequestSlots:
    """Touched from the event loop only, so a plain counter is enough."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_use = 0

    def acquire(self) -> Slot:
        """A slot, or a 429 that says when to come back."""
        if self.in_use >= self.limit:
            raise ApiError(
                429,
                f"this worker already holds {self.limit} requests (max_concurrent_requests); retry later",
                code="too_many_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_use += 1
        return Slot(self)
