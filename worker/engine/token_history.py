"""The token ids of the sequences whose sampling depends on them (penalties), kept on the device.

Why not a [rows, vocab] count tensor that lives as long as the rows: at 152k tokens of vocabulary that is 600 KB per
sequence in int32, 150 MB for 256 sequences, whatever their length. Here each tracked sequence has a row of a pooled
int32 buffer [slots, width] holding its ids (its prompt too when a repetition penalty needs it), 4 bytes per token,
and the counts are rebuilt each step by one scatter over the rows' ids into a [P, V] tensor that lives for the step
only, as the step's logits [S, V] do. That scatter reads P x width ids (small next to the P x V logits it edits), and
the sampled token is appended on the device, so async scheduling never has to read it first.

Unused entries hold `vocab_size`: the scatter sends them to a spare column that is dropped, so no mask is needed.
The host knows every row's length (each sampled token lands at its sequence index), so nothing waits for the device.
"""

from __future__ import annotations

import torch

from tidal.worker.engine.host_tensors import int64_tensor, to_device


class TokenHistory:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._ids = self._empty(0, 0)  # [slots, width] int32
        self._slot_of: dict[int, int] = {}  # seq_id -> its row of _ids
        self._free: list[int] = []
        self._num_prompt: dict[int, int] = {}  # seq_id -> prompt tokens stored ahead of its generated ones

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slot_of

    @property
    def num_tracked(self) -> int:
        return len(self._slot_of)

    def track(self, seq_id: int, prompt_token_ids: list[int] | None) -> None:
        """Start a sequence's row (before its first sampled token); `prompt_token_ids` are stored when given."""
        if seq_id in self._slot_of:
            return
        if not self._free:
            self._grow(max(8, 2 * self._ids.shape[0]), self._ids.shape[1])
        slot = self._free.pop()
        self._slot_of[seq_id] = slot
        prompt = prompt_token_ids or []
        self._num_prompt[seq_id] = len(prompt)
        if prompt:
            self._fit_width(len(prompt))
            self._ids[slot, : len(prompt)].copy_(to_device(int64_tensor(prompt), self.device))

    def forget(self, seq_id: int) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        del self._num_prompt[seq_id]
        if not self._slot_of:  # no one left: give the memory back rather than keep the widest row's width
            self._ids = self._empty(0, 0)
            self._free = []
            return
        # Queued behind any step still writing this row (the device runs them in order), ahead of its next owner.
        # Inference mode: the buffer was made under it (by the sampler), and only there may it be changed in place.
        with torch.inference_mode():
            self._ids[slot].fill_(self.vocab_size)
        self._free.append(slot)

    def stored_len(self, seq_id: int, num_output_tokens: int) -> int:
        """Entries of a sequence's row once it holds `num_output_tokens` generated tokens."""
        return self._num_prompt[seq_id] + num_output_tokens

    def num_prompt_stored(self, seq_id: int) -> int:
        return self._num_prompt[seq_id]

    def slot(self, seq_id: int) -> int:
        return self._slot_of[seq_id]

    def reserve(self, width: int) -> None:
        """Make every row at least `width` entries wide (before a step appends up to that index)."""
        self._fit_width(width)

    def gather(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """slots [P] int64 on the device -> their first `width` entries [P, width] int64 (padding = vocab_size)."""
        return self._ids[:, :width].index_select(0, slots).long()

    def append(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write tokens [P] at (slots [P], positions [P]) on the device, queued behind their sampling."""
        width = self._ids.shape[1]
        self._ids.view(-1).index_copy_(0, slots * width + positions, tokens.to(torch.int32))

    def _fit_width(self, width: int) -> None:
        if width > self._ids.shape[1]:
            self._grow(self._ids.shape[0], max(64, 1 << (width - 1).bit_length()))

    def _grow(self, slots: int, width: int) -> None:
        # Doubling keeps the copies amortised; the old rows keep their place.
        grown = self._empty(slots, width)
        old_slots, old_width = self._ids.shape
        grown[:old_slots, :old_width].copy_(self._ids)
        self._free.extend(range(slots - 1, old_slots - 1, -1))
        self._ids = grown

    def _empty(self, slots: int, width: int) -> torch.Tensor:
        return torch.full((slots, width), self.vocab_size, dtype=torch.int32, device=self.device)
