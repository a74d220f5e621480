"""Linear layers: a plain one and one that fuses several checkpoint projections into one matmul.

Besides the cuBLAS forward, a linear layer runs its projection for a few rows on the small-batch kernels
(tidal.kernels.small_batch_linear), with the RMSNorm before it or the residual add after it in the same launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.kernels.small_batch_linear import NormInput, linear_rows_into_residual_triton, linear_rows_triton
from tidal.worker.layers.checkpoint import new_weight


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = new_weight((out_features, in_features), dtype, device)  # [out, in]
        self.bias = new_weight((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)

    def forward_normed_rows(self, x: NormInput, eps: float, gated: bool = False) -> torch.Tensor:
        """linear(rms_norm(h)) of at most 16 rows in one launch, the norm given by its unscaled input `x` and its
        `eps`: the products are scaled by 1/rms. `gated`: the weight stacks gate and up, and the result is
        silu(gate) * up ([T, out / 2])."""
        return linear_rows_triton(x.scaled, self.weight, self.bias, x.partial_sq, eps, gated=gated)

    def forward_into_residual(
        self, x: torch.Tensor, residual: torch.Tensor, next_gamma: torch.Tensor
    ) -> tuple[torch.Tensor, NormInput]:
        """x [T <= 16, in] -> (h = residual + linear(x), the input of the RMSNorm with weight `next_gamma` over h),
        in one launch."""
        return linear_rows_into_residual_triton(x, self.weight, residual, next_gamma, self.bias)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        tensors = {f"{path}.weight": self.weight.data}
        if self.bias is not None:
            tensors[f"{path}.bias"] = self.bias.data
        return tensors


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up). `parts` maps each checkpoint
    projection's name (a sibling of this module, e.g. "q_proj") to its output size, in output order."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, sum(parts.values()), bias, dtype, device)
        self.parts = dict(parts)

    def split_sizes(self) -> list[int]:
        return list(self.parts.values())

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        parent = path.rsplit(".", 1)[0]
        tensors: dict[str, torch.Tensor] = {}
        start = 0
        for name, size in self.parts.items():
            tensors[f"{parent}.{name}.weight"] = self.weight.data[start : start + size]
            if self.bias is not None:
                tensors[f"{parent}.{name}.bias"] = self.bias.data[start : start + size]
            start += size
        return tensors
