"""Linear layers: a plain one and one that fuses several checkpoint projections into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
