"""Linear layers: a plain one and one that fuses several checkpoint projections into one matmul.

Besides the cuBLAS forward, a linear layer runs its projection for a few rows on the small-batch kernels
(tidal.kernels.small_batch_linear), with the RMSNorm before it or the residual add after it in the same launch.

A layer may hold FP8 weights (`hold_fp8`, before its parameters are placed; tidal.worker.layers.fp8_weights
decides which): an e4m3 `weight` and one fp32 `weight_scale` per output channel, served under the checkpoint's
names plus `<name>.weight_scale`. The forward then runs the FP8 GEMM (tidal.kernels.fp8_linear), and the
small-batch kernels read the e4m3 weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.kernels.fp8_linear import QuantizedRows, fp8_linear
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.small_batch_linear import NormInput, linear_rows_into_residual_triton, linear_rows_triton
from tidal.worker.layers.checkpoint import new_weight


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = new_weight((out_features, in_features), dtype, device)  # [out, in]
        self.bias = new_weight((out_features,), dtype, device) if bias else None
        self.weight_scale: nn.Parameter | None = None  # [out] fp32 when the weight is e4m3

    def hold_fp8(self) -> None:
        """From now on the weight is e4m3 with a scale per output channel (see the module docstring). Only before
        the parameters are placed (on the meta device): the weights region is sized from them."""
        if not self.weight.is_meta:
            raise RuntimeError("FP8 weights are chosen before a model's parameters are placed")
        out_features, in_features = self.weight.shape
        self.weight = new_weight((out_features, in_features), FP8_E4M3, self.weight.device)
        self.weight_scale = new_weight((out_features,), torch.float32, self.weight.device)

    @property
    def takes_quantized_rows(self) -> bool:
        """Whether `forward` takes its input as QuantizedRows (FP8 weights): the kernel making the input then
        quantizes it, and no launch of its own does."""
        return self.weight_scale is not None

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if isinstance(x, QuantizedRows):
            raise TypeError("quantized rows reach only a projection with FP8 weights")
        return F.linear(x, self.weight, self.bias)

    def forward_normed_rows(self, x: NormInput, eps: float, gated: bool = False) -> torch.Tensor:
        """linear(rms_norm(h)) of at most 16 rows in one launch, the norm given by its unscaled input `x` and its
        `eps`: the products are scaled by 1/rms. `gated`: the weight stacks gate and up, and the result is
        silu(gate) * up ([T, out / 2])."""
        return linear_rows_triton(
            x.scaled, self.weight, self.bias, x.partial_sq, eps, gated=gated, weight_scale=self.weight_scale
        )

    def forward_into_residual(
        self, x: torch.Tensor, residual: torch.Tensor, next_gamma: torch.Tensor
    ) -> tuple[torch.Tensor, NormInput]:
        """x [T <= 16, in] -> (h = residual + linear(x), the input of the RMSNorm with weight `next_gamma` over h),
        in one launch."""
        return linear_rows_into_residual_triton(
            x, self.weight, residual, next_gamma, self.bias, weight_scale=self.weight_scale
        )

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        tensors = {f"{path}.weight": self.weight.data}
        if self.weight_scale is not None:
            tensors[f"{path}.weight_scale"] = self.weight_scale.data
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
            if self.weight_scale is not None:
                tensors[f"{parent}.{name}.weight_scale"] = self.weight_scale.data[start : start + size]
            if self.bias is not None:
                tensors[f"{parent}.{name}.bias"] = self.bias.data[start : start + size]
            start += size
        return tensors
