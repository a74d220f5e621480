"""A writable memoryview over a contiguous CPU tensor's bytes, for hashing and positional file reads.

`Tensor.numpy()` would do, but it marks the tensor's storage as not resizable for good, and the CPU regions release
their memory by resizing their storage (tidal.worker.memory.regions.TorchRegion), so the bytes are wrapped through their
address instead. The caller keeps the tensor alive while the view is used.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
