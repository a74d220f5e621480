"""The paged KV cache's one region: every layer's K and V tensor is a view into it, laid out by kv_placement.py.

Where the provider maps memory in pieces (CUDA VMM), `restore` maps the first share of every K and V tensor and
`restore_rest` the remainder; `usable_blocks` says how many blocks (the lowest ids) have memory now.
"""

from __future__ import annotations

import math

import torch

from tidal.kernels.kv_layout import cache_view, v_tokens_innermost
from tidal.worker.memory.kv_placement import packed_kv, place_kv
from tidal.worker.memory.provider import MemoryProvider
from tidal.worker.memory.regions import DeviceRegion

# Per layer (k, v), each [num_blocks, block_size, kv_heads, hd]; V of an FP8 cache as a tokens-innermost view
# (kernels/kv_layout.py).
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Bytes of each layer's K and V mapped before serving resumes on a wake (the rest follows while serving): for a
# Llama-3-8B shape, 2048 blocks of 16 tokens, 4 GiB in all, created in ~7 ms.
KV_FIRST_SHARE_BYTES = 64 * 2**20


class KVCacheRegion:
    def __init__(
        self,
        memory: MemoryProvider,
        num_layers: int,
        block_shape: tuple[int, int, int],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`block_shape`: one block of one layer's K (or V), (block_size, num_kv_heads, head_dim)."""
        num_planes = 2 * num_layers
        block_bytes = math.prod(block_shape) * dtype.itemsize
        granularity = memory.mapping_granularity(device)
        if granularity is None:
            self.placement = packed_kv(num_planes, num_blocks, block_bytes)
        else:
            self.placement = place_kv(num_planes, num_blocks, block_bytes, granularity, KV_FIRST_SHARE_BYTES)
        pieces = [(p.offset, p.size) for p in self.placement.first + self.placement.rest]
        self.region: DeviceRegion = memory.region(self.placement.total, device, pieces=pieces)
        self.num_blocks = num_blocks
        self.nbytes = sum(size for _, size in pieces)
        plane_bytes, v_inner = self.placement.plane_bytes, v_tokens_innermost(dtype)
        planes = [
            cache_view(self.region.tensor[o : o + plane_bytes].view(dtype), block_shape, v_inner and i % 2 == 1)
            for i, o in enumerate(self.placement.plane_offsets)
        ]
        self.caches: KVCaches = [(planes[2 * i], planes[2 * i + 1]) for i in range(num_layers)]
        # Zeroed once, here, as a guard only: no attention result (kernels and references alike) depends on anything
        # past a sequence's written context (decode reads its last page whole and zeroes what lies past the end), so
        # the memory a wake maps again is left as the driver gives it (zeroing 100+ GiB would lengthen every wake).
        self.region.tensor.zero_()

    @property
    def usable_blocks(self) -> int:
        if not self.region.is_resident:
            return 0
        return self.num_blocks if self.region.is_complete else self.placement.first_blocks

    @property
    def is_resident(self) -> bool:
        return self.region.is_resident

    def release(self) -> None:
        self.region.release()

    def restore(self) -> None:
        """Map the first share (all of it where the region maps at once)."""
        self.region.restore(num_pieces=len(self.placement.first))

    def restore_rest(self) -> None:
        self.region.restore_rest()

    def data_ptr(self) -> int:
        return self.region.data_ptr()
