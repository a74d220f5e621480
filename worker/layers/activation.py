"""Gated activations (tidal.kernels.activation)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        return silu_and_mul(x)
