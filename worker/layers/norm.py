"""RMSNorm over the last dimension, with the residual add fused in (tidal.kernels.rms_norm).

The small-batch decoder path never launches this norm: the projection after it scales its products by 1/rms, and the
projection before it writes `NormInput` (tidal.kernels.small_batch_linear). `gamma`, `eps` and `norm_input` are what
that path reads from here. Qwen3's per-head q/k norms are not launched either: `head_norm` hands them to the kernel
that rotates q and k (tidal.kernels.rotary_store_kv, or small_batch_qkv on the small-batch path).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.rms_norm import Normed, rms_norm
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import NormInput, norm_input_reference
from tidal.worker.layers.checkpoint import new_weight


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_weight((hidden_size,), dtype, device)  # [H]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False
    ) -> Normed | tuple[Normed, torch.Tensor]:
        """x [T, H]. With `residual`: returns (norm(x + residual), x + residual), the latter the new residual.
        `quantize`: the normed rows as QuantizedRows, for a projection with FP8 weights."""
        return rms_norm(x, self.weight, self.eps, residual, quantize)

    def head_norm(self) -> HeadNorm:
        """This norm applied to each head of q or k (Qwen3's q/k norm; the weight [head_dim]): the kernel that rotates
        the heads (rotary+store, or the small-batch qkv) normalises them first, so the norm is never a launch of its
        own."""
        return HeadNorm(self.weight, self.eps)

    @property
    def gamma(self) -> torch.Tensor:
        """The weight [H]; a small-batch projection that feeds this norm multiplies its output by it in its epilogue."""
        return self.weight

    def norm_input(self, hidden: torch.Tensor) -> NormInput:
        """This norm's input as the small-batch kernels take it (h * gamma and sums of h^2, not yet scaled by 1/rms):
        how the residual stream enters the first fused layer, a few torch ops once per step."""
        return norm_input_reference(hidden, self.weight)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {f"{path}.weight": self.weight.data}
