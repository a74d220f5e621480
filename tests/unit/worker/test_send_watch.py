"""SendWatch cancels a stream only for one write that outlasts the timeout: never for many quick writes, slow
engine output between writes, or a write that finishes just in time."""

from __future__ import annotations

import asyncio

from tidal.worker.server.send_watch import SendWatch

TIMEOUT = 0.1


async def _writes(durations: list[float], gap_s: float) -> tuple[bool, float]:
    """Writes of the given lengths with `gap_s` between them -> (cancelled by the watch, when)."""
    task = asyncio.current_task()
    assert task is not None
    watch = SendWatch(task, TIMEOUT)
    start = asyncio.get_running_loop().time()
    try:
        for duration in durations:
            await asyncio.sleep(gap_s)
            watch.write_started()
            await asyncio.sleep(duration)
            watch.write_done()
    except asyncio.CancelledError:
        assert watch.fired
        task.uncancel()
        return True, asyncio.get_running_loop().time() - start
    finally:
        watch.stop()
    return False, asyncio.get_running_loop().time() - start


def test_many_quick_writes_over_several_timeouts_are_fine():
    fired, took = asyncio.run(_writes([0.0] * 60, 0.005))
    assert not fired and took > 2 * TIMEOUT


def test_a_long_wait_between_writes_is_not_a_slow_write():
    fired, _ = asyncio.run(_writes([0.0, 0.0], 3 * TIMEOUT))
    assert not fired


def test_a_write_under_the_timeout_is_fine_after_a_stuck_looking_start():
    fired, _ = asyncio.run(_writes([0.6 * TIMEOUT, 0.6 * TIMEOUT, 0.0], 0.3 * TIMEOUT))
    assert not fired


def test_a_stuck_write_is_cancelled_at_its_deadline():
    # The watch's first look comes at TIMEOUT, mid-write; it then waits for this write's own deadline.
    fired, took = asyncio.run(_writes([10.0], 0.5 * TIMEOUT))
    assert fired
    assert 1.5 * TIMEOUT <= took < 2.5 * TIMEOUT  # 0.5 of gap + the full timeout; not the 2x of a periodic look
