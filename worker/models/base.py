"""What every model implementation offers the engine (forward, logits, KV shape, checkpoint names)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

import torch
from torch import nn
from transformers import PretrainedConfig

from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.layers.checkpoint import collect_checkpoint_tensors
from tidal.worker.layers.expert_parallel import ExpertParallelSettings, ExpertParallelState


@dataclass(frozen=True)
class KVCacheSpec:
    """What one KV cache block costs: per layer, K and V of [block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


@runtime_checkable
class BuildsBuffers(Protocol):
    """A layer whose buffers are derived from its configuration (a rotary cache): built on the meta device with
    their shapes only, it computes them on the real device once the model's weights have their place."""

    def build_buffers(self, device: torch.device) -> None: ...


class CausalLM(nn.Module, ABC):
    """A decoder-only model assembled from tidal.worker.layers."""

    # Set by a model whose experts are spread over an expert-parallel group; None for every other model.
    expert_parallel: ExpertParallelState | None = None

    @classmethod
    @abstractmethod
    def from_hf_config(
        cls,
        hf_config: PretrainedConfig,
        dtype: torch.dtype,
        device: torch.device,
        expert_parallel: ExpertParallelSettings | None = None,
    ) -> Self:
        """Build the model for `hf_config`. The loader builds it on the meta device, gives its parameters their
        place (tidal.worker.memory.parameters) and fills them; buffers come from `materialize_buffers`.
        `expert_parallel`: this process's place in its group; only a model with expert layers uses it (a dense
        model runs whole on every rank)."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, H]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in the model's dtype (the sampler widens what it edits)."""

    @property
    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """The width of the hidden states `forward` returns."""

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors that may be present but are not weights of this implementation."""
        return name.endswith("rotary_emb.inv_freq")

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> live tensor (views into fused weights); stable for the model's lifetime, except that an
        expert-parallel model's expert names follow its slots (they change when an epoch is installed)."""
        return collect_checkpoint_tensors(self)

    def materialize_buffers(self, device: torch.device) -> None:
        """Compute every derived buffer on `device` (after a build on the meta device); every buffer must have
        memory afterwards."""
        for module in self.modules():
            if isinstance(module, BuildsBuffers):
                module.build_buffers(device)
        left = [name for name, buffer in self.named_buffers() if buffer.is_meta]
        if left:
            raise RuntimeError(f"buffers {left[:3]} have no memory: their layer must implement build_buffers")
