"""Gated activations (tidal.kernels.activation)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.activation import silu_and_mul
from tidal.kernels.fp8_linear import QuantizedRows


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:  # [T, 2*I] -> [T, I]
        """`quantize`: the result as QuantizedRows, for a projection with FP8 weights."""
        return silu_and_mul(x, quantize)
