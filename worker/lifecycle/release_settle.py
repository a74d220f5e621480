"""Waiting, after a sleep released device memory, until the driver has finished clearing it.

Measured on an H200 (`benchmarks/lifecycle_wake_breakdown.py --after-sleep`, results in
benchmarks/results/lifecycle-wake-after-sleep-h200.txt): for a while after device memory is released, host->device
copies run at ~30 instead of ~55 GB/s, for a time in proportion to the bytes released (~0.35 s after a 111 GiB KV
cache, under 50 ms after 15 GiB of weights), whether or not a device->host copy came first; the driver's free-memory
figure does not show it. The driver clears released memory before handing it out again, and that work shares the
device with our copies. A wake issued inside that window paid for it: its weights copy took 1.8x its own time.

So a sleep answers only once a small probe copy runs at the rate it ran when the worker started (or a deadline has
passed): "asleep" then means the device is quiet, and a wake right after it, or another process's work, no longer
shares the device with the clearing. The wait moves the cost from the wake to the sleep; it does not remove it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

log = logging.getLogger(__name__)

PROBE_BYTES = 64 * 2**20  # ~1.2 ms at 55 GB/s: fine-grained, and long enough to time with events
RECOVERED_SHARE = 0.85  # while the driver clears, the probe ran at ~0.55 of its reference rate
PASSES_NEEDED = 2  # consecutive probes at the reference rate before the device counts as quiet


class ReleaseSettle:
    """`take_reference()` before releasing device memory, `wait()` after; both no-ops off CUDA or with `timeout_s` 0.

    The reference is taken at each sleep, right before its release, so it reflects the device as it is then (another
    process's copies included) rather than at start."""

    def __init__(self, host: torch.Tensor, device: torch.device, timeout_s: float = 2.0) -> None:
        """`host`: a pinned host buffer the probe copies from (only ever read)."""
        self.device = device
        self.timeout_s = timeout_s
        self.last_wait_s = 0.0
        self._source = host.view(torch.uint8).reshape(-1)[:PROBE_BYTES]
        self._usable = device.type == "cuda" and self._source.is_pinned() and self._source.numel() > 0
        self._reference_gbps: float | None = None
        self._scratch: torch.Tensor | None = None

    def take_reference(self) -> None:
        self.discard()
        if not self._usable or self.timeout_s <= 0:
            return
        try:
            with self._on_device():  # events and copy on the engine's device, whichever is current on this thread
                self._scratch = torch.empty(self._source.numel(), dtype=torch.uint8, device=self.device)
                self._reference_gbps = max(self._probe(self._scratch) for _ in range(3))
        except Exception:  # a best-effort probe: no device memory for it, or a driver error, costs the wait only
            log.info("no release probe for this sleep (it will not wait)", exc_info=True)
            self.discard()

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def discard(self) -> None:
        """Forget the reference and free the probe's buffer (a sleep that failed before its wait)."""
        self._reference_gbps = None
        self._scratch = None

    def _probe(self, scratch: torch.Tensor) -> float:
        """One host->device copy's rate in GB/s, timed on the device (the current device: the caller's context)."""
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        scratch.copy_(self._source, non_blocking=True)
        end.record(stream)
        end.synchronize()
        elapsed_ms: float = start.elapsed_time(end)
        return self._source.numel() / max(elapsed_ms, 1e-6) / 1e6

    def wait(self) -> float:
        """Block until probes run at the reference rate again or `timeout_s` passed; -> seconds waited. Frees the
        probe's buffer (to torch's cache)."""
        scratch, reference = self._scratch, self._reference_gbps
        self.discard()
        self.last_wait_s = 0.0
        if scratch is None or reference is None:
            return 0.0
        start = time.monotonic()
        passes = 0
        rate = 0.0
        try:
            with self._on_device():
                while passes < PASSES_NEEDED:
                    rate = self._probe(scratch)
                    passes = passes + 1 if rate >= RECOVERED_SHARE * reference else 0
                    if passes < PASSES_NEEDED and time.monotonic() - start > self.timeout_s:
                        log.warning(
                            "host->device copies still at %.0f of %.0f GB/s %.1fs after the sleep's release (the "
                            "driver clearing memory, or another process's copies); answering the sleep anyway",
                            rate, reference, self.timeout_s,
                        )  # fmt: skip
                        break
        except Exception:
            log.info("the release probe failed; answering the sleep without waiting further", exc_info=True)
        self.last_wait_s = time.monotonic() - start
        return self.last_wait_s
