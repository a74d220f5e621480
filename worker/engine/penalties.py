"""Presence, frequency and repetition penalties on a batch's logits, from token counts kept on the device.

Semantics: presence and frequency as OpenAI's (over the generated tokens only: minus presence once for a token that
appeared, minus frequency times its count); repetition as HF's and vLLM's (over prompt and generated tokens: a
positive logit is divided by it, a negative one multiplied), applied first. Only the rows that ask for a penalty are
touched: one gather, one or two scatters and a few elementwise passes over their [P, V] logits (costs: token_history).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tidal.worker.engine.host_tensors import float32_tensor, int64_tensor, to_device
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.token_history import TokenHistory


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [P, V] fp32; output_counts [P, V] (generated occurrences); seen [P, V] bool (in prompt or output, None
    when no row has a repetition penalty); presence, frequency, repetition [P]. -> penalised logits [P, V]."""
    if seen is not None:
        rep = repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


class PenaltyStep(NamedTuple):
    """What a step's penalised rows need again once their tokens are sampled (to append them)."""

    rows: torch.Tensor  # [P] int64, rows of the batch
    slots: torch.Tensor  # [P] int64, rows of the history
    positions: torch.Tensor  # [P] int64, where each sampled token goes in its history row


class Penalties:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._history: TokenHistory | None = None  # made on first use: the vocabulary comes with the logits

    def forget(self, seq_id: int) -> None:
        if self._history is not None:
            self._history.forget(seq_id)

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> PenaltyStep | None:
        """Penalise, in place, the rows of logits [S, V] whose requests ask for it (the batch has its control
        columns); -> what `record` needs."""
        picked = [r for r, p in enumerate(batch.params) if p.has_penalties]
        if not picked:
            return None
        vocab = logits.shape[1]
        history = self._history
        if history is None:
            history = self._history = TokenHistory(logits.device, vocab)
        slots: list[int] = []
        positions: list[int] = []
        firsts: list[int] = []  # per row, where its generated ids start in its history row
        params: list[float] = []
        any_repetition = False
        for r in picked:
            p = batch.params[r]
            seq_id = batch.seq_ids[r]
            uses_repetition = p.repetition_penalty != 1.0
            any_repetition |= uses_repetition
            history.track(seq_id, batch.prompt(r) if uses_repetition else None)
            slots.append(history.slot(seq_id))
            positions.append(history.stored_len(seq_id, batch.num_output_tokens(r)))
            firsts.append(history.num_prompt_stored(seq_id))
            params += (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        width = max(positions)  # what is stored before this step's tokens
        history.reserve(width + 1)
        num = len(picked)
        ints = to_device(int64_tensor(picked + slots + positions + firsts), logits.device)  # [4P]
        rows_t, slots_t, positions_t, firsts_t = ints.split([num, num, num, num])
        per_row = to_device(float32_tensor(params), logits.device).view(num, 3)  # [P, 3]
        ids = history.gather(slots_t, width)  # [P, W]
        columns = torch.arange(width, device=logits.device)[None, :]  # [1, W]
        output_ids = ids.masked_fill(columns < firsts_t[:, None], vocab)  # the prompt's ids go to the spare column
        output_counts = _count(output_ids, vocab)  # [P, V]
        seen = _count(ids, vocab) > 0 if any_repetition else None
        sub = logits.index_select(0, rows_t)  # [P, V]
        sub = apply_penalties(sub, output_counts, seen, per_row[:, 0], per_row[:, 1], per_row[:, 2])
        logits.index_copy_(0, rows_t, sub)
        return PenaltyStep(rows_t, slots_t, positions_t)

    def record(self, step: PenaltyStep, tokens: torch.Tensor) -> None:
        """Append the step's sampled tokens [S] (on the device) to the penalised rows' histories."""
        if self._history is not None:
            self._history.append(step.slots, step.positions, tokens.index_select(0, step.rows))


def _count(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids [P, W] int64 in [0, vocab] -> occurrences [P, V] int32 (id `vocab` is padding, dropped)."""
    counts = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]
