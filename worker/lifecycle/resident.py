"""The model's weights and KV cache moved into releasable regions, plus the host copy of the weights.

`ResidentWeights` relocates every parameter into one region (the parameters become views into it, so the model code
is unchanged) and keeps a host buffer of the same layout, allocated once (pinned on CUDA): sleep level 1 is one
device-to-host copy, a wake one host-to-device copy, and a weight update is staged in the host buffer, checked, and
then copied in one go. `ResidentKVCache` does the same for the runner's KV cache, which needs no host copy.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.lifecycle import cuda_vmm
from tidal.worker.lifecycle.device_memory import DeviceRegion
from tidal.worker.lifecycle.kv_placement import packed_kv, place_kv
from tidal.worker.lifecycle.layout import check_tiling, pack
from tidal.worker.models.base import CausalLM

log = logging.getLogger(__name__)

RegionFactory = Callable[..., DeviceRegion]  # (nbytes, device, pieces=None) -> region

# Bytes of each layer's K and V mapped before serving resumes on a wake (the rest follows while serving): for a
# Llama-3-8B shape, 2048 blocks of 16 tokens, 4 GiB in all, created in ~7 ms.
KV_FIRST_SHARE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor lives in the region (and in the host buffer)."""

    offset: int  # bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def view_of(flat: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The slot's typed view into a flat uint8 buffer laid out like the region."""
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def free_cached_device_memory(device: torch.device, collect: bool = False) -> None:
    """Return torch's cached free blocks to the device (`collect`: first drop unreachable tensors)."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class ResidentWeights:
    def __init__(self, model: CausalLM, device: torch.device, make_region: RegionFactory) -> None:
        self.model = model
        self.device = device
        params = list(model.parameters())
        sizes = [p.numel() * p.element_size() for p in params]
        offsets, total = pack(sizes)
        self.region = make_region(total, device)
        with torch.no_grad():
            for param, offset, nbytes in zip(params, offsets, sizes, strict=True):
                moved = self.region.tensor[offset : offset + nbytes].view(param.dtype).view(param.shape)
                moved.copy_(param.data)
                param.data = moved  # tied modules share the Parameter object, so they follow
        del params
        free_cached_device_memory(device, collect=True)
        self.slots = self._slots(list(zip(offsets, sizes, strict=True)))
        self.nbytes = total
        # Allocated once: pinning gigabytes takes seconds, far more than the copy itself.
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        log.info("weights: %.2f GiB in a %s; host buffer pinned=%s", total / 2**30, type(self.region).__name__,
                 self.host.is_pinned())  # fmt: skip

    def _slots(self, params: list[tuple[int, int]]) -> dict[str, TensorSlot]:
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
        problems = check_tiling(spans, params)
        if problems:  # a model whose checkpoint names miss a parameter could not be updated or checksummed whole
            raise RuntimeError("checkpoint tensors do not tile the parameters: " + "; ".join(problems))
        return slots

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


class ResidentKVCache:
    """The runner's KV cache as views into one region (same block count and per-layer shape as the runner made
    it). Where the region maps in pieces (CUDA VMM), a restore maps the first share of every layer's K and V and
    `restore_rest` the remainder; `usable_blocks` says how many blocks (the lowest ids) have memory now."""

    def __init__(self, runner: ModelRunner, make_region: RegionFactory) -> None:
        self.runner = runner
        spec = runner.model.kv_cache_spec
        num_blocks = runner.num_kv_blocks
        shape = (num_blocks, runner.block_size, spec.num_kv_heads, spec.head_dim)
        num_planes = 2 * spec.num_layers
        block_bytes = runner.bytes_per_block // num_planes  # one block of one layer's K (or V)
        # Free the runner's own cache first: the region takes the same amount of memory.
        runner.kv_caches = []
        free_cached_device_memory(runner.device, collect=True)
        granularity = mapping_granularity(runner.device)
        if granularity is None:
            self.placement = packed_kv(num_planes, num_blocks, block_bytes)
        else:
            self.placement = place_kv(num_planes, num_blocks, block_bytes, granularity, KV_FIRST_SHARE_BYTES)
        pieces = [(p.offset, p.size) for p in self.placement.first + self.placement.rest]
        self.region = make_region(self.placement.total, runner.device, pieces=pieces)
        plane_bytes = self.placement.plane_bytes
        views = [
            self.region.tensor[o : o + plane_bytes].view(runner.dtype).view(shape) for o in self.placement.plane_offsets
        ]
        runner.kv_caches = [(views[2 * i], views[2 * i + 1]) for i in range(spec.num_layers)]
        self.num_blocks = num_blocks
        self.nbytes = sum(p.size for p in self.placement.first + self.placement.rest)
        # Zeroed once. Kernels never read a slot outside a sequence's written context (masked loads), so the
        # memory a wake maps again is left as the driver gives it.
        for k, v in runner.kv_caches:
            k.zero_()
            v.zero_()

    @property
    def usable_blocks(self) -> int:
        if not self.region.is_resident:
            return 0
        return self.num_blocks if self.region.is_complete else self.placement.first_blocks

    def release(self) -> None:
        self.region.release()

    def restore(self) -> None:
        """Map the first share (all of it where the region maps at once)."""
        self.region.restore(num_pieces=len(self.placement.first))

    def restore_rest(self) -> None:
        self.region.restore_rest()

    @property
    def is_resident(self) -> bool:
        return self.region.is_resident


def mapping_granularity(device: torch.device) -> int | None:
    """The CUDA driver's mapping granularity on `device`, or None where memory is not mapped in pieces."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return cuda_vmm.granularity(index)
    except cuda_vmm.CudaDriverError:
        return None
