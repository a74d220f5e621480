"""GroupLink: which epoch a rank steps with, and the order in which epochs may replace each other."""

from __future__ import annotations

import time

import pytest

from tidal.worker.engine.group_link import GroupLink, PendingEpoch
from tidal.worker.group.errors import GroupBrokenError


class FakeGroup:
    def __init__(self, epoch: int, members: tuple[int, ...] = (0, 1)) -> None:
        self.epoch = epoch
        self.members = members
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def find_culprit(self) -> tuple[int, str] | None:
        return (1, "rank 1 at 127.0.0.1:7100 is gone (connection refused)")


def _pending(epoch: int, installed: list[int]) -> PendingEpoch:
    return PendingEpoch(FakeGroup(epoch), lambda _engine: installed.append(epoch))  # type: ignore[arg-type]


def test_the_loop_switches_to_the_offered_epoch_and_closes_the_old_group():
    link, installed = GroupLink(0.02), []
    first = _pending(1, installed)
    link.offer(first)
    assert link.switch(None) is first and link.group is first.group and first.switched.result() is None  # type: ignore[arg-type]
    second = _pending(2, installed)
    link.offer(second)
    link.switch(None)  # type: ignore[arg-type]
    assert installed == [1, 2] and first.group.closed and link.group is second.group


def test_a_newer_epoch_replaces_a_pending_one_and_an_older_one_is_refused():
    link, installed = GroupLink(0.02), []
    older, newer = _pending(3, installed), _pending(4, installed)
    link.offer(older)
    link.offer(newer)
    with pytest.raises(GroupBrokenError, match="replaced by epoch 4"):
        older.switched.result(timeout=1)
    assert older.group.closed
    late = _pending(2, installed)  # prepared concurrently, finished last
    with pytest.raises(GroupBrokenError, match="overtaken by epoch 4"):
        link.offer(late)
    assert late.group.closed and link.pending is newer


def test_a_failed_install_keeps_the_old_group_and_fails_the_switch():
    link = GroupLink(0.02)
    link.offer(_pending(1, []))
    link.switch(None)  # type: ignore[arg-type]
    old_group = link.group

    def broken_install(_engine: object) -> None:
        raise RuntimeError("device copy failed")

    bad = PendingEpoch(FakeGroup(2), broken_install)  # type: ignore[arg-type]
    link.offer(bad)
    assert link.switch(None) is None  # type: ignore[arg-type]
    assert link.group is old_group and bad.group.closed
    with pytest.raises(RuntimeError, match="device copy failed"):
        bad.switched.result(timeout=1)


def test_a_break_stops_stepping_and_the_culprit_is_named_by_the_probe_thread():
    link = GroupLink(0.02)
    link.offer(_pending(5, []))
    link.switch(None)  # type: ignore[arg-type]
    group = link.group
    link.mark_broken(GroupBrokenError("all_to_all failed: Operation timed out!", epoch=5))
    assert link.group is None
    broken = link.broken
    assert broken is not None and broken.epoch == 5
    for _ in range(200):  # the probe runs on a thread of its own
        broken = link.broken
        if broken is not None and broken.peer_rank is not None:
            break
        time.sleep(0.01)
    assert broken is not None and broken.peer_rank == 1 and "connection refused" in broken.reason
    assert group is not None and group.closed  # type: ignore[attr-defined]
