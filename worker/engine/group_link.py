"""A rank's link to its expert-parallel group: the epoch it steps with, the next one waiting to be switched to, and
what broke the last one. The engine loop steps with it; the lifecycle prepares epochs and reads it for `/state`.

The loop thread is the only one that changes `group` (it switches at a step boundary agreed by all ranks, see
`lockstep`); the lifecycle only offers a `PendingEpoch` and waits for its future. Everything is under one lock, held
for field updates only, never across a collective.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.group.epoch_group import EpochGroup
from tidal.worker.group.errors import GroupBrokenError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BrokenGroup:
    epoch: int
    peer_rank: int | None
    reason: str
    since: float  # time.monotonic() when it broke


@dataclass
class PendingEpoch:
    """An epoch prepared off the loop (its process group joined, its experts staged): `install` runs on the loop
    thread at the switch, with the engine idle, and must be quick and unable to fail for a reason the preparation
    could have found."""

    group: EpochGroup
    install: Callable[[LLMEngine], None]
    switched: Future[None] = field(default_factory=Future)

    @property
    def epoch(self) -> int:
        return self.group.epoch


class GroupLink:
    def __init__(self, idle_poll_s: float) -> None:
        self.idle_poll_s = idle_poll_s
        self._lock = threading.Lock()
        self._group: EpochGroup | None = None
        self._pending: PendingEpoch | None = None
        self._broken: BrokenGroup | None = None
        self._epoch_steps = 0
        self.waiting_on: str | None = None  # why this rank's work waits, from the last header (for /state)
        # Told when the link switched to an epoch (True) or broke (False), on the loop thread (for metrics).
        self.on_change: Callable[[bool], None] | None = None

    # ----- read by anyone -----
    @property
    def group(self) -> EpochGroup | None:
        with self._lock:
            return self._group

    @property
    def pending(self) -> PendingEpoch | None:
        with self._lock:
            return self._pending

    @property
    def broken(self) -> BrokenGroup | None:
        with self._lock:
            return self._broken

    @property
    def epoch_steps(self) -> int:
        return self._epoch_steps

    # ----- the lifecycle -----
    def offer(self, pending: PendingEpoch) -> None:
        """Hand the loop an epoch to switch to; a newer one replaces one not switched to yet (whose group closes).
        GroupBrokenError for one older than the epoch pending or served (prepared concurrently, overtaken)."""
        with self._lock:
            newest = max(
                self._pending.epoch if self._pending is not None else 0, self._group.epoch if self._group else 0
            )
            if pending.epoch <= newest:
                pending.group.close()
                raise GroupBrokenError(f"overtaken by epoch {newest}", epoch=pending.epoch)
            replaced, self._pending = self._pending, pending
        if replaced is not None:
            replaced.switched.set_exception(
                GroupBrokenError(f"replaced by epoch {pending.epoch}", epoch=replaced.epoch)
            )
            replaced.group.close()

    def withdraw(self, pending: PendingEpoch) -> None:
        """Drop `pending` if it was not switched to (its switch timed out): the old state stays."""
        with self._lock:
            if self._pending is not pending:
                return
            self._pending = None
        pending.group.close()

    # ----- the loop thread -----
    def switch(self, engine: LLMEngine) -> PendingEpoch | None:
        """Install the pending epoch and step with its group from now on; -> it (None if there was none)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.install(engine)
        except Exception as err:  # the old group (if any) is left as it was: its epoch goes on or stays broken
            log.exception("installing epoch %d failed", pending.epoch)
            pending.group.close()
            pending.switched.set_exception(err)
            return None
        with self._lock:
            old, self._group, self._broken = self._group, pending.group, None
            self._epoch_steps = 0
        if old is not None:
            old.close()
        pending.switched.set_result(None)
        log.info("stepping with epoch %d (members %s)", pending.epoch, list(pending.group.members))
        if self.on_change is not None:
            self.on_change(True)
        return pending

    def mark_broken(self, error: GroupBrokenError) -> None:
        """The group's collective failed: stop stepping with it, keep everything else, wait for the next epoch.
        Which peer failed is found by probing on a thread of its own, so the next epoch is never kept waiting."""
        with self._lock:
            group, self._group = self._group, None
            broken = self._broken = BrokenGroup(error.epoch, error.peer_rank, error.reason, time.monotonic())
        log.error("group broken: %s; holding requests until the next epoch", error)
        if self.on_change is not None:
            self.on_change(False)
        if group is not None:
            threading.Thread(target=self._blame, args=(group, broken), name="tidal-group-probe", daemon=True).start()

    def _blame(self, group: EpochGroup, broken: BrokenGroup) -> None:
        """Name the culprit, then give the group up (closing it can wait on the frozen peer: never before naming)."""
        try:
            culprit = group.find_culprit()
            if culprit is not None:
                peer, why = culprit
                log.error("epoch %d broke: %s", broken.epoch, why)
                with self._lock:
                    if self._broken is broken:  # not replaced by a newer epoch or a newer failure meanwhile
                        self._broken = BrokenGroup(broken.epoch, peer, f"{why}; {broken.reason}", broken.since)
        finally:
            group.close()

    def count_step(self) -> None:
        self._epoch_steps += 1

    def close(self) -> None:
        with self._lock:
            group, self._group = self._group, None
            pending, self._pending = self._pending, None
        for g in (group, pending.group if pending is not None else None):
            if g is not None:
                g.close()
        if pending is not None and not pending.switched.done():
            pending.switched.set_exception(GroupBrokenError("the engine shut down", epoch=pending.epoch))
