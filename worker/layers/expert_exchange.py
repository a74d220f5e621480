"""What an expert-parallel rank's MoE layers exchange with their group: bytes always, time when asked.

Each MoE layer of a group step has two phases on the wire: dispatch (the row counts, then the rows out to the ranks
holding their experts) and combine (the expert outputs back). Bytes cost nothing to count: the row counts are on the
host already, because the exchange needs them there. Only rows that cross a link count, sent and received: rows for
the rank's own slots go through the collective but never leave it, and the counts' few bytes are left out.

Time is another matter. On a GPU a collective runs on NCCL's stream behind the layer's own kernels, so a host timer
around the call would also count the kernels queued before it (attention and the router before the dispatch, the
expert GEMMs before the combine). Timed (`EngineConfig.time_expert_exchanges`), each phase first waits for the
device to finish what is queued, then for the phase itself: the figure is the exchange alone, waiting for the
slowest peer included. The price is the overlap of queueing the collective behind the kernels, so it is a setting
for measuring where a step's time goes (benchmarks/ep_group_perf.py), not for serving.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PHASES = ("dispatch", "combine")


@dataclass(frozen=True)
class ExchangeTotals:
    """One phase's totals since the model was loaded (monotonic: Prometheus counters read them)."""

    phase: str
    exchanges: int  # one per MoE layer per group step (empty steps included: the rank still serves its peers)
    bytes_sent: int  # to other ranks
    bytes_received: int  # from other ranks
    seconds: float | None  # None: not timed


@dataclass(frozen=True)
class ExchangeSnapshot:
    steps: int  # group steps (forwards and empty steps) since the model was loaded
    phases: tuple[ExchangeTotals, ...]  # one per phase, in PHASES order


class ExchangeStats:
    """Per-phase totals of one model's MoE layers, and the group steps they were taken in (forwards and empty steps,
    counted by the model). Written by the engine's step thread only; a scrape reads a `snapshot`, whose numbers
    are each read whole."""

    def __init__(self, timed: bool) -> None:
        self.timed = timed
        self.steps = 0
        self._exchanges = dict.fromkeys(PHASES, 0)
        self._sent = dict.fromkeys(PHASES, 0)
        self._received = dict.fromkeys(PHASES, 0)
        self._seconds = dict.fromkeys(PHASES, 0.0)

    def count_step(self) -> None:
        self.steps += 1

    def add(self, phase: str, bytes_sent: int, bytes_received: int) -> None:
        self._exchanges[phase] += 1
        self._sent[phase] += bytes_sent
        self._received[phase] += bytes_received

    @contextlib.contextmanager
    def timing(self, phase: str, device: torch.device) -> Iterator[None]:
        """Around one phase's collectives: adds their time when timed, else does nothing."""
        if not self.timed:
            yield
            return
        _wait_for(device)  # what is queued before the exchange is not the exchange's
        start = time.perf_counter()
        yield
        _wait_for(device)  # and the exchange has finished, whatever its backend's wait() returned on
        self._seconds[phase] += time.perf_counter() - start

    def snapshot(self) -> ExchangeSnapshot:
        phases = tuple(
            ExchangeTotals(
                phase,
                self._exchanges[phase],
                self._sent[phase],
                self._received[phase],
                self._seconds[phase] if self.timed else None,
            )
            for phase in PHASES
        )
        return ExchangeSnapshot(self.steps, phases)


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
