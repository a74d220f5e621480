"""The sleep's wait for the device to be quiet after a release (tidal.worker.lifecycle.release_settle), with the
probe's rates scripted: the CUDA behaviour itself is measured by benchmarks/lifecycle_wake_breakdown.py."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator

import pytest
import torch

from tidal.worker.lifecycle.release_settle import PASSES_NEEDED, ReleaseSettle


def scripted(rates: Iterable[float], timeout_s: float = 2.0) -> tuple[ReleaseSettle, Iterator[float]]:
    settle = ReleaseSettle(torch.zeros(1024, dtype=torch.uint8), torch.device("cpu"), timeout_s)
    settle._usable = True  # as if CUDA with a pinned buffer: the scratch buffer lands on the CPU
    it = iter(rates)
    settle._probe = lambda scratch: next(it)  # type: ignore[method-assign]
    return settle, it


def test_off_cuda_nothing_is_probed_and_nothing_waits() -> None:
    settle = ReleaseSettle(torch.zeros(1024, dtype=torch.uint8), torch.device("cpu"))
    settle.take_reference()
    assert settle.wait() == 0.0


def test_waits_until_the_probe_runs_at_the_reference_rate_twice_in_a_row() -> None:
    # reference: best of three (55); after the release 30, 30, one recovered probe, a relapse, then two recovered.
    settle, rest = scripted([50, 55, 54, 30, 30, 50, 31, 48, 52, 99])
    settle.take_reference()
    assert settle.wait() >= 0.0
    assert list(rest) == [99]  # stopped right after the second consecutive probe at >= 85% of 55
    assert PASSES_NEEDED == 2


def test_gives_up_at_the_deadline_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    settle, _ = scripted(itertools.chain([55, 55, 55], itertools.repeat(20)), timeout_s=0.02)
    settle.take_reference()
    with caplog.at_level(logging.WARNING):
        waited = settle.wait()
    assert 0.02 <= waited < 1.0
    assert "still at 20 of 55 GB/s" in caplog.text


def test_a_zero_timeout_turns_it_off() -> None:
    settle, rest = scripted([55, 20, 20], timeout_s=0)
    settle.take_reference()
    assert settle.wait() == 0.0
    assert list(rest) == [55, 20, 20]  # not one probe


def test_each_wait_needs_its_own_reference() -> None:
    settle, rest = scripted([55, 55, 55, 50, 50, 7])
    settle.take_reference()
    settle.wait()
    assert settle.wait() == 0.0  # a second wait without a new reference (no release in between) does not probe
    assert list(rest) == [7]


def test_a_failing_probe_costs_the_wait_only() -> None:
    settle, _ = scripted([])  # the first probe raises (StopIteration stands for a driver error)
    settle.take_reference()
    assert settle.wait() == 0.0

    settle, _ = scripted(itertools.chain([55, 55, 55], [30]))  # the reference works, a probe after it fails
    settle.take_reference()
    assert 0.0 <= settle.wait() < 1.0


def test_a_sleep_that_fails_between_reference_and_wait_frees_the_probe() -> None:
    settle, rest = scripted([55, 55, 55, 55, 55])
    settle.take_reference()
    assert settle._scratch is not None
    settle.discard()
    assert settle._scratch is None
    assert settle.wait() == 0.0
    assert list(rest) == [55, 55]  # nothing probed after the discard
