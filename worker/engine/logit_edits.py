"""Sparse, per-request edits of a batch's logits: `logit_bias` (added) and the stop tokens that `min_tokens` bans
(EOS unless ignored, and `stop_token_ids`, set to -inf until enough tokens were generated).

Each request's entries go to the device once, on its first step, and stay there until it ends; a step then
concatenates its rows' entries and adds them with one index_add_ into the flattened logits. The host work per step
is a loop over the rows that have entries (never over the vocabulary), and the row of each entry is expanded on the
device with an explicit output size, so nothing waits for the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tidal.worker.engine.host_tensors import float32_tensor, int64_tensor, to_device
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampling_params import SamplingParams


class _Entries(NamedTuple):
    token_ids: torch.Tensor  # [N] int64 on the device
    values: torch.Tensor  # [N] fp32 on the device


class LogitEdits:
    def __init__(self, device: torch.device, eos_token_ids: frozenset[int]) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._bias: dict[int, _Entries] = {}  # seq_id -> its logit_bias
        self._bans: dict[int, _Entries] = {}  # seq_id -> what min_tokens forbids

    def forget(self, seq_id: int) -> None:
        self._bias.pop(seq_id, None)
        self._bans.pop(seq_id, None)

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        """Add every row's entries to logits [S, V], in place (the batch has its control columns)."""
        vocab = logits.shape[1]
        pieces: list[_Entries] = []
        owners: list[int] = []  # the row of each piece
        for r, params in enumerate(batch.params):
            if not params.has_logit_edits:
                continue
            seq_id = batch.seq_ids[r]
            if params.logit_bias:
                pieces.append(self._entries(self._bias, seq_id, params, vocab, ban=False))
                owners.append(r)
            if batch.num_output_tokens(r) < params.min_tokens:
                pieces.append(self._entries(self._bans, seq_id, params, vocab, ban=True))
                owners.append(r)
        sizes = [len(p.token_ids) for p in pieces]
        total = sum(sizes)
        if not total:
            return
        ints = to_device(int64_tensor(owners + sizes), logits.device)  # [2K]
        owners_t, sizes_t = ints.split([len(owners), len(sizes)])
        row_ids = owners_t.repeat_interleave(sizes_t, output_size=total)  # [N]; output_size: no wait for the device
        token_ids = torch.cat([p.token_ids for p in pieces])  # [N]
        values = torch.cat([p.values for p in pieces])  # [N]
        # index_add_ on the flat view: one kernel that never synchronises (a ban's -inf wins whatever the order).
        logits.view(-1).index_add_(0, row_ids * vocab + token_ids, values)

    def _entries(
        self, cache: dict[int, _Entries], seq_id: int, params: SamplingParams, vocab: int, ban: bool
    ) -> _Entries:
        entries = cache.get(seq_id)
        if entries is None:
            if ban:
                stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
                # An id past the vocabulary can never be sampled, so it needs no ban (and must not index the logits).
                ids = sorted(t for t in stops if t < vocab)
                values = [float("-inf")] * len(ids)
            else:
                # The engine refuses a bias key outside the vocabulary before the request is queued.
                ids = list(params.logit_bias)
                values = list(params.logit_bias.values())
            entries = cache[seq_id] = _Entries(
                to_device(int64_tensor(ids), self.device), to_device(float32_tensor(values), self.device)
            )
        return entries
