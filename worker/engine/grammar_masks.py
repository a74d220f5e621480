"""Applying structured rows' grammars to a batch's logits, on the device.

The structured rows' matchers fill a packed bitmask on the host ([R, ceil(V / 32)] int32, one bit per allowed token),
a row at a time on a few threads ("lanes", `fill_threads()` at most, each taking a contiguous share of the rows);
xgrammar fills outside the GIL, so the lanes run in parallel: at a 128k vocabulary one row took ~20-55 us, 5-14 ms
for 256 rows. With async scheduling the engine starts that fill (`prepare`) as soon as the step before has advanced
the matchers, and reads the rest of that step meanwhile. The bitmask goes over in one asynchronous copy, is unpacked
on the device and sets every disallowed logit of those rows to -inf. Only the rows that have a grammar are touched
(index_select / index_copy_), so the rest of the batch is bit for bit what it was, and nothing waits for the device.

A row's mask takes as long as its grammar makes it: an ambiguous grammar that compiles in a millisecond (`(w " "?)
{1,16}` with `w ::= [a-z]+`) takes ~1 s a mask at a 152k vocabulary (benchmarks/results/grammar-compile-ebnf.md), and
the step's sampling waits for every mask. So each row's fill is timed (by its thread's CPU time: a thread kept
waiting on a busy host is not the grammar's doing), and the wait is bounded: a row whose fill passes `limit_s` is
reported (`take_slow`, with how long it took) and its request is ended by the engine, and a row
still filling at its limit is not waited for: its lane is left to finish on its own (xgrammar cannot stop a fill;
its matcher is never touched again, as its request ends), the rows after it in that lane are filled on a fresh
lane, and its own row of the mask allows every token (the token sampled there is dropped with the request). The
fast path costs two clock reads a row. A step is thus held past its masks' real work by about the limit at most,
once per request that passes it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.sample_batch import SampleBatch

# A step's rows per lane below which a fill adds no lane (a lane costs a submit and a thread's wake-up, ~20 us).
ROWS_PER_LANE = 16
# The engine passes its config's limit; this default (for a sampler made on its own) is that field's, which says why.
DEFAULT_LIMIT_S = EngineConfig.model_fields["grammar_mask_limit_ms"].default / 1000


class _Lane:
    """Some rows of a fill, filled one at a time on a thread. `at`: (index in `rows` of the row in hand, the thread's
    CPU time when its fill began), None before the lane starts; `stop`, set by the waiting thread, keeps it from
    starting another row. Both change under `lock`, so the waiting thread knows which rows the lane will not touch.
    `cpu_clock`: the lane thread's CPU-time clock, which the waiting thread reads (None where the platform has none:
    then wall time stands in)."""

    __slots__ = ("at", "cpu_clock", "future", "lock", "over", "rows", "stop")

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.lock = threading.Lock()
        self.at: tuple[int, float] | None = None
        self.cpu_clock: int | None = None
        self.stop = False
        self.over: list[tuple[int, float]] = []  # (row, CPU seconds) of rows whose fill took longer than the limit
        self.future: Future[None] | None = None

    def cpu_time(self) -> float:
        """This lane's thread's CPU time (seconds), as `_fill_lane` reads it on the thread."""
        if self.cpu_clock is None:
            return time.perf_counter()
        try:
            return time.clock_gettime(self.cpu_clock)
        except OSError:  # the thread is gone: its lane is over, nothing of it is still filling
            return float("-inf")


def _own_cpu_clock() -> int | None:
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _fill_lane(matchers: list[Any], bitmask: torch.Tensor, lane: _Lane, limit_s: float) -> None:
    # A fill is judged by the CPU time it takes on its thread, not by the wall clock: a thread the OS (or another
    # thread holding the GIL) keeps waiting on a loaded host costs the grammar nothing, while an ambiguous grammar's
    # fill is CPU work all the way.
    lane.cpu_clock = _own_cpu_clock()
    for i, row in enumerate(lane.rows):
        with lane.lock:
            if lane.stop:
                return
            began = lane.cpu_time()
            lane.at = (i, began)
        matchers[row].fill_next_token_bitmask(bitmask, row)
        took = lane.cpu_time() - began
        if took > limit_s:
            lane.over.append((row, took))


class _Fill:
    """One sampling's masks being filled: the matchers in row order, their bitmask, and the lanes filling it."""

    def __init__(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.matchers = matchers
        self.bitmask = bitmask
        self.lanes: list[_Lane] = []
        self.stuck: list[int] = []  # rows left filling past the limit: their words are not to be read


class GrammarMasks:
    def __init__(self, device: torch.device, limit_s: float = DEFAULT_LIMIT_S) -> None:
        self.device = device
        self.limit_s = limit_s
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32] a bit's place in its word
        self._threads: ThreadPoolExecutor | None = None
        self._prepared: _Fill | None = None
        self._slow: list[tuple[Any, float]] = []  # (matcher, seconds) of rows past the limit, not yet taken

    def prepare(self, matchers: list[Any], vocab_size: int) -> None:
        """Start filling the masks of the next sampling's structured rows (`matchers`, each already advanced by its
        last token; None and finished ones are skipped) on the lanes: xgrammar fills outside the GIL, so the
        caller's own work (reading the step before) runs meanwhile. `apply` takes the result when its rows are
        these."""
        live = [m for m in matchers if m is not None and not m.is_terminated()]
        self.discard()
        if live:
            self._prepared = self._start(live, vocab_size)

    def discard(self) -> None:
        """Drop a prepared fill nobody will use; one still running is waited for (each row up to the limit), so a
        matcher is never filled and advanced at once."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self._wait(prepared)

    def take_slow(self) -> list[tuple[Any, float]]:
        """The matchers whose fill took longer than the limit since the last call, and the seconds it took (so far,
        for one left filling): their requests must end, as their next masks would be as slow."""
        slow, self._slow = self._slow, []
        return slow

    def close(self) -> None:
        """Drop any prepared fill and end the fill threads (the engine is shutting down); a later `prepare` starts
        new ones. A fill left running past its limit is not waited for."""
        self.discard()
        self._slow = []
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)

    def _start(self, matchers: list[Any], vocab_size: int) -> _Fill:
        import xgrammar

        shape = xgrammar.get_bitmask_shape(len(matchers), vocab_size)
        fill = _Fill(matchers, torch.empty(shape, dtype=torch.int32, pin_memory=self.device.type == "cuda"))
        num_lanes = max(1, min(fill_threads(), len(matchers) // ROWS_PER_LANE))
        per_lane = -(-len(matchers) // num_lanes)
        fill.lanes = [
            self._lane(fill, list(range(first, min(first + per_lane, len(matchers)))))
            for first in range(0, len(matchers), per_lane)
        ]
        return fill

    def _lane(self, fill: _Fill, rows: list[int]) -> _Lane:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(fill_threads(), thread_name_prefix="tidal-masks")
        lane = _Lane(rows)
        lane.future = self._threads.submit(_fill_lane, fill.matchers, fill.bitmask, lane, self.limit_s)
        return lane

    def _wait(self, fill: _Fill) -> None:
        """Wait for a fill's lanes, each until it is done or its row in hand has filled for the limit: that row is
        reported slow and left to its thread (the pool is replaced, so that later lanes do not queue behind it),
        and the lane's rows after it go to a new lane. A lane's error is raised here, as a fill made now would
        have raised it."""
        limit = self.limit_s
        running, fill.lanes = fill.lanes, []
        done: list[_Lane] = []
        while running:
            now = time.perf_counter()
            still: list[_Lane] = []
            deadline = now + limit  # a lane not started yet is not charged: look again after a limit
            for lane in running:
                assert lane.future is not None
                if lane.future.done():
                    done.append(lane)
                    continue
                with lane.lock:
                    at = lane.at
                    used = lane.cpu_time() - at[1] if at is not None else 0.0
                    stuck = used >= limit
                    lane.stop = stuck
                if not stuck:
                    still.append(lane)
                    # CPU time runs no faster than the wall clock: the row cannot pass the limit sooner than this.
                    deadline = min(deadline, now + limit - used)
                    continue
                assert at is not None
                row = lane.rows[at[0]]
                fill.stuck.append(row)
                self._slow.append((fill.matchers[row], used))
                self._slow.extend((fill.matchers[r], s) for r, s in list(lane.over) if r != row)
                threads, self._threads = self._threads, None
                if threads is not None:
                    threads.shutdown(wait=False)  # its other lanes run on; the stuck thread ends after its fill
                if at[0] + 1 < len(lane.rows):
                    still.append(self._lane(fill, lane.rows[at[0] + 1 :]))
            running = still
            if running:
                timeout = max(0.0, deadline - time.perf_counter())
                wait_futures([lane.future for lane in running if lane.future is not None], timeout, FIRST_COMPLETED)
        for lane in done:
            self._slow.extend((fill.matchers[r], s) for r, s in lane.over)
        for lane in done:
            assert lane.future is not None
            lane.future.result()

    def _bitmask(self, matchers: list[Any], vocab_size: int) -> torch.Tensor:
        """The rows' masks: the prepared ones if they cover these matchers (rows ended since are dropped), else
        filled now. A row left filling past the limit allows every token (its request is ending)."""
        fill, self._prepared = self._prepared, None
        if fill is not None:
            self._wait(fill)  # a fill that failed raises here, as it would have filled now
            if fill.matchers != matchers and not {id(m) for m in matchers} <= {id(m) for m in fill.matchers}:
                fill = None  # rows not in the prepared fill (rows ended since are only dropped)
        if fill is None:
            fill = self._start(matchers, vocab_size)
            self._wait(fill)
        bitmask = fill.bitmask
        if fill.stuck:
            bitmask = bitmask.clone()  # the stuck rows' threads may still write theirs
            bitmask[fill.stuck] = -1
        if fill.matchers == matchers:  # the usual case: the same rows, in the same order (compared by identity)
            return bitmask
        place = {id(m): i for i, m in enumerate(fill.matchers)}
        return bitmask.index_select(0, int64_tensor([place[id(m)] for m in matchers]))

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        """Mask logits [S, V] in place for the rows that have a matcher (the batch has its matchers column)."""
        matchers = batch.matchers or []
        rows = [r for r, m in enumerate(matchers) if m is not None]
        if not rows:
            self.discard()
            return
        vocab = logits.shape[1]
        bitmask = self._bitmask([matchers[r] for r in rows], vocab)  # [R, W]
        bits = to_device(bitmask, logits.device)  # [R, W]
        allowed = (bits.unsqueeze(-1) >> self._shifts) & 1  # [R, W, 32]
        allowed = allowed.view(len(rows), -1)[:, :vocab].bool()  # [R, V]
        rows_t = to_device(int64_tensor(rows), logits.device)  # [R]
        masked = logits.index_select(0, rows_t).masked_fill_(~allowed, float("-inf"))  # [R, V]
        logits.index_copy_(0, rows_t, masked)


def fill_threads() -> int:
    """Threads for filling masks: xgrammar's "auto" is the host's whole core count, which in a container limited to
    a few of them oversubscribes it; half the cores this process may run on (the step thread and the server's
    event loop need the rest), at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))
