"""Applying structured rows' grammars to a batch's logits, on the device.

The structured rows' matchers fill a packed bitmask on the host ([R, ceil(V / 32)] int32, one bit per allowed token)
in one call that spreads the rows over xgrammar's own threads (outside the GIL): at a 128k vocabulary one row takes
~30-130 us, so 256 rows filled one after another would take longer than the forward they overlap. The bitmask
goes over in one asynchronous copy, is unpacked on the device and sets every disallowed logit of those rows to
-inf. Only the rows that have a grammar are touched (index_select / index_copy_), so the rest of the batch is bit
for bit what it was, and nothing waits for the device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.sample_batch import SampleBatch


class GrammarMasks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32] a bit's place in its word
        self._filler: Any = None  # xgrammar.BatchGrammarMatcher, made on first use (xgrammar is imported lazily)

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        """Mask logits [S, V] in place for the rows that have a matcher (the batch has its matchers column)."""
        import xgrammar

        matchers = batch.matchers or []
        rows = [r for r, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        vocab = logits.shape[1]
        bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)  # [R, W] int32 on the host
        if self._filler is None:
            self._filler = xgrammar.BatchGrammarMatcher(max_threads=fill_threads())
        self._filler.batch_fill_next_token_bitmask([matchers[r] for r in rows], bitmask)
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
