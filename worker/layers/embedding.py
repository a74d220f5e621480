"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.kernels.small_batch_linear import linear_rows_triton, uses_small_batch_kernels
from tidal.worker.layers.checkpoint import new_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = new_weight((vocab_size, hidden_size), dtype, device)  # [V, H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(input_ids, self.weight)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {f"{path}.weight": self.weight.data}


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits. Tied: it reads the embedding's tensor and owns no
    checkpoint tensor of its own (a checkpoint's redundant lm_head.weight is then ignored by the loader)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tied = tied_to is not None
        # Tied: the very same Parameter object, so an in-place update of the embedding updates the head.
        self.weight = tied_to.weight if tied_to is not None else new_weight((vocab_size, hidden_size), dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] in the weight's dtype
        # Not widened to fp32 here: at batch 256 and a 128k vocabulary that copy alone took ~100 us a step, and a
        # greedy row's argmax over bf16 picks the same token as over its exact fp32 widening. The sampler widens
        # only the rows it edits, scales or scores (Sampler.sample_with_logprobs).
        if uses_small_batch_kernels(hidden):  # a few rows: one pass over the weight, ahead of cuBLAS there
            return linear_rows_triton(hidden, self.weight)
        return F.linear(hidden, self.weight)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {} if self.tied else {f"{path}.weight": self.weight.data}
