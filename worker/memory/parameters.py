"""A module's parameters given their one place in device memory: views into one region, bound before any weight
is read, so the weights are allocated once, where they stay (no second copy, no relocation later)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.memory.layout import pack
from tidal.worker.memory.provider import MemoryProvider
from tidal.worker.memory.regions import DeviceRegion


def place_parameters(module: nn.Module, memory: MemoryProvider, device: torch.device) -> DeviceRegion:
    """Bind every parameter of `module`, built on the meta device, to a view into one new region on `device`
    (uninitialised; the caller fills it). Each Parameter keeps its identity, so modules that share one (tied
    embeddings) still share it."""
    params = list(module.parameters())  # de-duplicated: a shared Parameter is placed once
    placed = [name for name, p in module.named_parameters() if not p.is_meta]
    if placed:
        raise ValueError(f"parameters must be built on the meta device; {placed[:3]} already have memory")
    sizes = [p.numel() * p.element_size() for p in params]
    offsets, total = pack(sizes)
    region = memory.region(total, device)
    with torch.no_grad():
        for param, offset, nbytes in zip(params, offsets, sizes, strict=True):
            view = region.tensor[offset : offset + nbytes].view(param.dtype).view(param.shape)
            torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
    return region
