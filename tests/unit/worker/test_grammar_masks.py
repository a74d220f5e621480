"""GrammarMasks' bound on a row's fill (fake matchers, CPU): a row past the limit is reported with its time and not
waited for, the rows after it are filled all the same, and a batch of fast rows is filled as before."""

from __future__ import annotations

import hashlib
import threading
import time

import torch

from tidal.worker.engine.grammar_masks import GrammarMasks
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampling_params import SamplingParams

VOCAB = 64  # two words a row
LIMIT_S = 0.05
_BLOCK = bytes(1 << 18)


def burn_cpu(seconds: float, until: threading.Event | None = None) -> None:
    """Spends `seconds` of this thread's CPU time (or, with `until`, CPU time until it is set) outside the GIL, as
    a slow xgrammar fill does: hashlib lets the GIL go for large inputs. The limit is on a fill's CPU time."""
    end = time.thread_time() + seconds
    while (time.thread_time() < end) if until is None else not until.is_set():
        hashlib.sha256(_BLOCK).digest()


class FakeMatcher:
    """Allows token `allowed` only; its fill burns `fill_s` of CPU (with `release`, until it is set), or with
    `sleep_s` waits that long without using the CPU (a thread the host keeps waiting)."""

    def __init__(
        self, allowed: int, fill_s: float = 0.0, release: threading.Event | None = None, sleep_s: float = 0.0
    ) -> None:
        self.allowed = allowed
        self.fill_s = fill_s
        self.release = release
        self.sleep_s = sleep_s
        self.fills = 0

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        self.fills += 1
        burn_cpu(self.fill_s, self.release)
        time.sleep(self.sleep_s)
        bitmask[index] = 0
        word, bit = divmod(self.allowed, 32)
        bitmask[index, word] = (1 << bit) if bit < 31 else -(1 << 31)
        return True


def masked(masks: GrammarMasks, matchers: list[FakeMatcher]) -> torch.Tensor:
    logits = torch.zeros(len(matchers), VOCAB)
    batch = SampleBatch([SamplingParams()] * len(matchers), list(range(len(matchers))), matchers=matchers)
    masks.apply(logits, batch)
    return logits


def test_fast_rows_are_masked_and_nothing_is_reported():
    masks = GrammarMasks(torch.device("cpu"), LIMIT_S)
    matchers = [FakeMatcher(i % VOCAB) for i in range(40)]  # several lanes
    masks.prepare(matchers, VOCAB)
    logits = masked(masks, matchers)
    assert [int(row.argmax()) for row in logits] == [m.allowed for m in matchers]
    assert torch.isinf(logits).sum() == len(matchers) * (VOCAB - 1)
    assert masks.take_slow() == []
    masks.close()


def test_a_row_past_the_limit_is_reported_and_not_waited_for():
    masks = GrammarMasks(torch.device("cpu"), LIMIT_S)
    release = threading.Event()  # the stuck row's fill ends only when the test says so
    stuck = FakeMatcher(5, release=release)
    over = FakeMatcher(6, fill_s=LIMIT_S * 1.5)  # caught filling past the limit, or done past it
    matchers = [FakeMatcher(i) for i in range(20)] + [stuck, over] + [FakeMatcher(i) for i in range(20, 40)]
    masks.prepare(matchers, VOCAB)
    start = time.perf_counter()
    logits = masked(masks, matchers)
    waited = time.perf_counter() - start
    try:
        assert waited < 5 * LIMIT_S, f"the step waited {waited:.2f} s for a stuck row"
        slow = dict((id(m), s) for m, s in masks.take_slow())
        assert set(slow) == {id(stuck), id(over)}
        assert slow[id(stuck)] >= LIMIT_S and slow[id(over)] >= LIMIT_S
        for row, m in enumerate(matchers):
            if m is over:
                continue  # its mask is whichever of the two it was
            if m is stuck:
                assert not torch.isinf(logits[row]).any()  # allows every token: its request is ending
            else:
                assert int(logits[row].argmax()) == m.allowed and torch.isinf(logits[row]).sum() == VOCAB - 1
        assert all(m.fills == 1 for m in matchers)  # each row filled once: the rows after the stuck one too
        # The next fill does not queue behind the stuck thread.
        fast = [FakeMatcher(i) for i in range(3)]
        masks.prepare(fast, VOCAB)
        start = time.perf_counter()
        masked(masks, fast)
        assert time.perf_counter() - start < LIMIT_S
        assert masks.take_slow() == []
    finally:
        release.set()
        masks.close()


def test_a_row_done_past_the_limit_before_the_wait_is_reported_with_its_mask():
    """A fill that ran while the engine read the step before: the row is done, but took longer than the limit."""
    masks = GrammarMasks(torch.device("cpu"), LIMIT_S)
    over = FakeMatcher(6, fill_s=LIMIT_S * 1.5)
    matchers = [FakeMatcher(1), over, FakeMatcher(2)]
    masks.prepare(matchers, VOCAB)
    time.sleep(LIMIT_S * 3)
    logits = masked(masks, matchers)
    [(matcher, seconds)] = masks.take_slow()
    assert matcher is over and seconds >= LIMIT_S * 1.5
    assert [int(row.argmax()) for row in logits] == [1, 6, 2]
    masks.close()


def test_a_fill_kept_waiting_by_the_host_is_not_the_grammars_doing():
    """Past the limit in wall time but not in CPU time (the thread was kept off a core, or waited): not reported,
    and waited for."""
    masks = GrammarMasks(torch.device("cpu"), LIMIT_S)
    waiting = FakeMatcher(3, sleep_s=LIMIT_S * 3)
    matchers = [FakeMatcher(1), waiting]
    masks.prepare(matchers, VOCAB)
    logits = masked(masks, matchers)
    assert masks.take_slow() == []
    assert [int(row.argmax()) for row in logits] == [1, 3]  # its own mask, not "every token"
    masks.close()
