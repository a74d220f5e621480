"""The dense gated feed-forward block (SwiGLU) of Llama-like models."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        parts = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, parts, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act(self.gate_up_proj(x)))  # via [T, 2*I] and [T, I]
