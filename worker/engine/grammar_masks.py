"""Applying structured rows' grammars to a batch's logits, on the device.

The structured rows' matchers fill a packed bitmask on the host ([R, ceil(V / 32)] int32, one bit per allowed token)
in one call that spreads the rows over xgrammar's own threads (outside the GIL): at a 128k vocabulary one row took
~20-55 us, 5-14 ms for 256 rows. With async scheduling the engine starts that fill (`prepare`) as soon as the
step before has advanced the matchers, and reads the rest of that step meanwhile. The bitmask
goes over in one asynchronous copy, is unpacked on the device and sets every disallowed logit of those rows to
-inf. Only the rows that have a grammar are touched (index_select / index_copy_), so the rest of the batch is bit
for bit what it was, and nothing waits for the device.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.sample_batch import SampleBatch


class GrammarMasks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32] a bit's place in its word
        self._filler: Any = None  # xgrammar.BatchGrammarMatcher, made on first use (xgrammar is imported lazily)
        self._thread: ThreadPoolExecutor | None = None
        self._prepared: tuple[list[Any], Future[torch.Tensor]] | None = None  # (matchers, their bitmask)

    def prepare(self, matchers: list[Any], vocab_size: int) -> None:
        """Start filling the masks of the next sampling's structured rows (`matchers`, each already advanced by its
        last token; None and finished ones are skipped) on a thread: xgrammar fills outside the GIL, so the caller's
        own work (reading the step before) runs meanwhile. `apply` takes the result when its rows are these."""
        live = [m for m in matchers if m is not None and not m.is_terminated()]
        self.discard()
        if not live:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tidal-masks")
        self._prepared = (live, self._thread.submit(self._fill, live, vocab_size))

    def discard(self) -> None:
        """Drop a prepared fill nobody will use; one still running is waited for, so the shared filler is never
        used from two threads at once."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and not prepared[1].cancel():
            prepared[1].exception()  # waits; a failed fill of masks nobody needs is no error

    def close(self) -> None:
        """Drop any prepared fill and end the fill thread (the engine is shutting down); a later `prepare` starts a
        new one."""
        self.discard()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)

    def _fill(self, matchers: list[Any], vocab_size: int) -> torch.Tensor:
        """-> [R, W] int32 on the host (pinned on CUDA: the copy to the device needs no staging), every word
        written by the matchers."""
        import xgrammar

        shape = xgrammar.get_bitmask_shape(len(matchers), vocab_size)
        bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        if self._filler is None:
            self._filler = xgrammar.BatchGrammarMatcher(max_threads=fill_threads())
        self._filler.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def _bitmask(self, matchers: list[Any], vocab_size: int) -> torch.Tensor:
        """The rows' masks: the prepared ones if they cover these matchers (rows ended since are dropped), else
        filled now."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            live, future = prepared
            bitmask = future.result()  # a fill that failed raises here, as it would have filled now
            if live == matchers:  # the usual case: the same rows, in the same order (compared by identity)
                return bitmask
            place = {id(m): i for i, m in enumerate(live)}
            if all(id(m) in place for m in matchers):
                return bitmask.index_select(0, int64_tensor([place[id(m)] for m in matchers]))
        return self._fill(matchers, vocab_size)

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
