"""Naming a model's weights the way the Hugging Face checkpoint does, as views into the live tensors.

Each layer that owns weights implements `checkpoint_tensors(path)`, where `path` is the layer's module path
(which the models keep equal to the checkpoint's prefix). A fused layer returns one view per checkpoint tensor
(q_proj/k_proj/v_proj into qkv_proj), so loading, in-place weight updates and checksums all work on the
checkpoint's names while the forward pass uses the fused tensor at a stable address.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class HasCheckpointTensors(Protocol):
    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]: ...


def collect_checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> view of the live tensor, for every weight of `model`."""
    tensors: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        if isinstance(module, HasCheckpointTensors):
            tensors.update(module.checkpoint_tensors(path))
    return tensors


def new_weight(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Weights are inference-only: no grad. Allocated once where they live; later updates copy into them."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
