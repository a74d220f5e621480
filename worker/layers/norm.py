"""RMSNorm over the last dimension, with the residual add fused in (tidal.kernels.rms_norm).

The small-batch decoder path never launches this norm: the projection after it scales its products by 1/rms, and the
projection before it writes `NormInput` (tidal.kernels.small_batch_linear). `gamma`, `eps` and `norm_input` are what
that path reads from here.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tidal.kernels.rms_norm import rms_norm
from tidal.kernels.small_batch_linear import NormInput, norm_input_reference
from tidal.worker.layers.checkpoint import new_weight


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_weight((hidden_size,), dtype, device)  # [H]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]. With `residual`: returns (norm(x + residual), x + residual), the latter the new residual."""
        return rms_norm(x, self.weight, self.eps, residual)

    def forward_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] normalised per head (Qwen3's q/k norm)."""
        num_tokens, num_heads, head_dim = x.shape
        normed = rms_norm(x.reshape(num_tokens * num_heads, head_dim), self.weight, self.eps)
        return cast(torch.Tensor, normed).view(x.shape)  # one tensor: no residual was given

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
