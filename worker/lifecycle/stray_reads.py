"""Reads an update (or a level-2 wake's re-read) gave up on that may still write into the weights' host memory.

A checkpoint read blocked in the kernel (a stalled network file system) cannot be interrupted: when an update, or a
level-2 wake re-reading the served version, passes its deadline it fails and the worker is no longer busy, but the
blocked thread writes into its destination if the read ever returns. Until then every operation that writes or trusts
the host buffer (another update, sleep, wake, checksum) is refused with the reason; serving from the device copy goes
on. If the file system never answers, only a restart of the worker frees the thread.
"""

from __future__ import annotations

import threading

from tidal.worker.lifecycle.errors import WeightsUnavailableError


class StrayReads:
    def __init__(self) -> None:
        self._pending: list[threading.Event] = []

    def add(self, settled: threading.Event) -> None:
        """`settled` is set once the reads it stands for have returned."""
        self._pending.append(settled)

    def check(self, operation: str) -> None:
        """WeightsUnavailableError while a read given up on may still write into host memory."""
        self._pending = [e for e in self._pending if not e.is_set()]
        if self._pending:
            raise WeightsUnavailableError(
                f"cannot {operation}: a checkpoint read of an earlier update or wake passed its deadline and is still "
                "blocked in the kernel (a stalled file system?); it may yet write into the weights' host buffer. "
                "Serving goes on; retry once the file system answers, or restart the worker"
            )
