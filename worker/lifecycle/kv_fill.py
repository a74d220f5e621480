"""Mapping the rest of the KV cache after a wake, while the engine already serves on its first share.

Creating device memory does not overlap the weights' copy (memory/kv_placement.py says why the wake splits the
cache), so the wake maps a first share of every layer's K and V, serving resumes on those blocks, and this thread
maps the remainder; only when all of it is mapped does the block manager get the remaining blocks, between two
steps. A sleep joins the thread before it releases the region. If the memory is no longer there (another process
took it while this one slept), the worker keeps serving on the first share and says so in the log; the next wake
tries again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tidal.worker.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class _PiecewiseKV(Protocol):
    num_blocks: int

    @property
    def usable_blocks(self) -> int: ...

    def restore_rest(self) -> None: ...


class KVFill:
    def __init__(
        self, kv: _PiecewiseKV, between_steps: Callable[[], contextlib.AbstractContextManager[LLMEngine]]
    ) -> None:
        self._kv = kv
        self._between_steps = between_steps
        self._thread: threading.Thread | None = None
        self.last_seconds: float | None = None  # from start() until every block was usable, for the last wake
        self.last_error: str | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Map what the wake left out, on a thread (nothing to do when the cache is whole)."""
        self.join()
        if self._kv.usable_blocks >= self._kv.num_blocks:
            self.last_seconds, self.last_error = 0.0, None
            return
        self._thread = threading.Thread(target=self._fill, args=(time.monotonic(),), name="kv-fill", daemon=True)
        self._thread.start()

    def join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _fill(self, started: float) -> None:
        try:
            self._kv.restore_rest()
            with self._between_steps() as llm:
                llm.block_manager.set_num_usable(self._kv.usable_blocks)
        except Exception as err:
            self.last_seconds, self.last_error = None, f"{type(err).__name__}: {err}"
            log.error(
                "could not map the rest of the KV cache after the wake (%s): serving on %d of %d blocks until "
                "the next wake",
                self.last_error,
                self._kv.usable_blocks,
                self._kv.num_blocks,
            )
            return
        self.last_seconds, self.last_error = time.monotonic() - started, None
        log.info("KV cache whole again %.3fs after the wake (%d blocks)", self.last_seconds, self._kv.num_blocks)
