"""The dense gated feed-forward block (SwiGLU) of Llama-like models."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.fp8_linear import QuantizedRows
from tidal.kernels.small_batch_linear import NormInput
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

    @property
    def takes_quantized_rows(self) -> bool:
        """Whether `forward` takes its input as QuantizedRows (FP8 gate/up weights; see Linear)."""
        return self.gate_up_proj.takes_quantized_rows

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [T, H] -> [T, H]
        act = self.act(self.gate_up_proj(x), quantize=self.down_proj.takes_quantized_rows)  # [T, I]
        out: torch.Tensor = self.down_proj(act)
        return out

    def forward_small_batch(
        self, x: NormInput, eps: float, residual: torch.Tensor, next_gamma: torch.Tensor
    ) -> tuple[torch.Tensor, NormInput]:
        """residual + forward(rms_norm(h)) for at most 16 rows in two launches, from the norm's unscaled input `x` and
        its `eps`: gate/up scales by 1/rms and applies SiLU-and-mul, down adds into the residual stream and writes the
        input of the next norm (weight `next_gamma`). -> (the new residual stream [T, H], that input)."""
        act = self.gate_up_proj.forward_normed_rows(x, eps, gated=True)  # [T, I]
        return self.down_proj.forward_into_residual(act, residual, next_gamma)
