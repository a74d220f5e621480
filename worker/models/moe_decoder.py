"""The decoder with mixture-of-experts blocks in place of (some of) its dense MLPs; the families' shared part.

A family gives its attention settings (`spec_from_config`, as the dense families do), its expert settings
(`moe_spec_from_config`) and which layers keep a dense MLP (`dense_mlp_layers`). A model with any expert layer runs
the unfused decoder forward only (`DecoderLayer.fuses_small_batches`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Self

import torch
from torch import nn
from transformers import PretrainedConfig

from tidal.worker.layers.moe import MoeSpec, SparseMoE
from tidal.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    @classmethod
    @abstractmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec: ...

    @classmethod
    def dense_mlp_layers(cls, cfg: PretrainedConfig) -> frozenset[int]:
        """Layers with the dense MLP (of `intermediate_size`) instead of experts; none by default."""
        return frozenset()

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> Self:
        spec = cls.spec_from_config(hf_config)
        return cls(spec, cls.moe_spec_from_config(hf_config), cls.dense_mlp_layers(hf_config), dtype, device)

    def __init__(
        self,
        spec: DecoderSpec,
        moe: MoeSpec,
        dense_layers: frozenset[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # Set before the decoder's constructor, which calls make_mlp; plain values, so nn.Module allows it early.
        self.moe = moe
        self.dense_layers = dense_layers
        super().__init__(spec, dtype, device)

    def make_mlp(self, spec: DecoderSpec, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if layer_idx in self.dense_layers:
            return super().make_mlp(spec, layer_idx, dtype, device)
        return SparseMoE(spec.hidden_size, self.moe, dtype, device)
