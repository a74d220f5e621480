"""Who makes an engine's device memory: plain torch storage, or CUDA virtual memory whose addresses survive a sleep.

The place that builds the engine picks the provider (`memory_provider`); the loader asks it for the weights' region
and the runner for the KV cache's, each once. Both kinds of region can be released and restored (regions.py), so any
engine can sleep; they differ in whether a restore keeps the addresses, and in whether memory maps in pieces.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from tidal.worker.memory import cuda_vmm
from tidal.worker.memory.regions import DeviceRegion, TorchRegion, VmmRegion

log = logging.getLogger(__name__)

Pieces = list[tuple[int, int]]  # (offset, size) in bytes, in the order a restore maps them


class MemoryProvider(ABC):
    @abstractmethod
    def region(self, nbytes: int, device: torch.device, pieces: Pieces | None = None) -> DeviceRegion:
        """A new region of `nbytes` on `device` (uninitialised). `pieces`: where the region maps in pieces, how
        to cut it (multiples of `mapping_granularity`); ignored by a region that maps whole."""

    @abstractmethod
    def mapping_granularity(self, device: torch.device) -> int | None:
        """The size a piece must be a multiple of on `device`, or None where regions map whole."""


class TorchMemory(MemoryProvider):
    """Ordinary torch storage (any device). A restore may move it (see regions.TorchRegion)."""

    def region(self, nbytes: int, device: torch.device, pieces: Pieces | None = None) -> DeviceRegion:
        return TorchRegion(nbytes, device)

    def mapping_granularity(self, device: torch.device) -> int | None:
        return None


class VmmMemory(MemoryProvider):
    """CUDA virtual memory: addresses stay across a sleep, and the KV cache can come back in pieces. Off CUDA, or
    where the driver API does not work, a region falls back to torch storage (logged: its addresses can move)."""

    def region(self, nbytes: int, device: torch.device, pieces: Pieces | None = None) -> DeviceRegion:
        if device.type == "cuda":
            try:
                return VmmRegion(nbytes, device, pieces)
            except (cuda_vmm.CudaDriverError, RuntimeError, TypeError) as err:
                log.warning("CUDA virtual memory unavailable (%s): addresses will move across sleep", err)
        return TorchRegion(nbytes, device)

    def mapping_granularity(self, device: torch.device) -> int | None:
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            return cuda_vmm.granularity(index)
        except cuda_vmm.CudaDriverError:
            return None


def memory_provider(stable_addresses: bool) -> MemoryProvider:
    """CUDA virtual memory where addresses must survive a sleep (CUDA graphs then need no recapture), else torch."""
    return VmmMemory() if stable_addresses else TorchMemory()
