"""RMSNorm over the last dimension, with the residual add fused in (tidal.kernels.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.kernels.rms_norm import rms_norm
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
        return rms_norm(x.reshape(num_tokens * num_heads, head_dim), self.weight, self.eps).view(x.shape)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {f"{path}.weight": self.weight.data}
