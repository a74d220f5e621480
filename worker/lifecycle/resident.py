"""The served weights' host copy: a buffer of the weights region's layout, and the named slots of the checkpoint.

The engine placed every parameter in one region (tidal.worker.memory); `ResidentWeights` keeps a host buffer of
the same layout, allocated once (pinned on CUDA): sleep level 1 is one device-to-host copy, a wake one host-to-device
copy, and a weight update is staged in the host buffer, checked, and then copied in one go.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from tidal.worker.memory.layout import check_tiling
from tidal.worker.memory.regions import DeviceRegion
from tidal.worker.models.base import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor lives in the region (and in the host buffer)."""

    offset: int  # bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def view_of(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's typed view into a flat uint8 buffer laid out like the region."""
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class ResidentWeights:
    """The weights' region (the engine's; released and restored here, never replaced) and its host buffer."""

    def __init__(self, model: CausalLM, region: DeviceRegion) -> None:
        self.model = model
        self.region = region
        self.device = region.device
        self.nbytes = region.nbytes
        self.slots = self._slots()
        # Allocated once: pinning gigabytes takes seconds, far more than the copy itself.
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        log.info("weights: %.2f GiB in a %s; host buffer pinned=%s", self.nbytes / 2**30, type(region).__name__,
                 self.host.is_pinned())  # fmt: skip

    def _slots(self) -> dict[str, TensorSlot]:
        base = self.region.data_ptr()
        slots: dict[str, TensorSlot] = {}
        for name, view in self.model.checkpoint_weights().items():
            if not view.is_contiguous():
                raise RuntimeError(f"checkpoint tensor {name} is not contiguous in the model")
            offset = view.data_ptr() - base
            if not 0 <= offset < self.region.nbytes:
                raise RuntimeError(f"checkpoint tensor {name} is not inside the weights region")
            slots[name] = TensorSlot(offset, tuple(view.shape), view.dtype)
        spans = [(n, s.offset, s.nbytes) for n, s in slots.items()]
        params = [(p.data_ptr() - base, p.numel() * p.element_size()) for p in self.model.parameters()]
        problems = check_tiling(spans, params)
        if problems:  # a model whose checkpoint names miss a parameter could not be updated or checksummed whole
            raise RuntimeError("checkpoint tensors do not tile the parameters: " + "; ".join(problems))
        return slots

    def refresh_slots(self) -> None:
        """Name the region again after the model's checkpoint names moved (expert parallelism: another epoch's
        experts in the slots); the region and the host buffer stay."""
        self.slots = self._slots()

    # ----- named views -----
    def host_views(self) -> dict[str, torch.Tensor]:
        return {name: view_of(self.host, slot) for name, slot in self.slots.items()}

    # ----- moves -----
    def to_host(self) -> int:
        """Device -> host buffer; -> bytes copied."""
        self.host.copy_(self.region.tensor, non_blocking=True)
        self.synchronize()
        return self.nbytes

    def to_device(self, wait: bool = True) -> int:
        """Host buffer -> device (every byte: the slots tile the region); -> bytes copied. `wait=False` returns
        once the copy is queued (call `synchronize()` before relying on it)."""
        self.region.tensor.copy_(self.host, non_blocking=True)
        if wait:
            self.synchronize()
        return self.nbytes

    def release(self) -> None:
        self.region.release()

    def restore(self) -> None:
        self.region.restore()

    @property
    def is_resident(self) -> bool:
        return self.region.is_resident

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
