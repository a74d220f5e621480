"""Sizing the paged KV cache (per layer, K and V of [num_blocks, block_size, kv_heads, head_dim]), and the throwaway
cache of the profiling run. The cache that serves lives in a region (tidal.worker.memory.kv_region)."""

from __future__ import annotations

import logging

import torch

from tidal.kernels.kv_layout import new_kv_cache_pair
from tidal.worker.memory.kv_region import KVCaches
from tidal.worker.models.base import KVCacheSpec

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def throwaway_kv_caches(
    spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """A small cache from torch's allocator for one profiling forward. Zeroed because that forward writes nothing
    (its slot mapping is all padding) yet attends over the blocks: its reads must see finite values."""
    block_shape = (block_size, spec.num_kv_heads, spec.head_dim)
    return [new_kv_cache_pair(num_blocks, block_shape, dtype, device) for _ in range(spec.num_layers)]


def num_blocks_for_bytes(num_bytes: int, bytes_per_block: int) -> int:
    return num_bytes // bytes_per_block


def gpu_kv_cache_bytes(device: torch.device, memory_fraction: float, graph_pool_bytes: int = 0) -> int:
    """The share of the device's free memory the KV cache may take, measured after the weights were loaded and a
    worst-case forward was profiled (its activations stay in torch's cache and are reused, so they are not free),
    less `graph_pool_bytes` held back for the CUDA graphs captured after the cache is allocated."""
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_cache_budget(free, memory_fraction, graph_pool_bytes)
    log.info(
        "GPU memory: %.2f GiB free of %.2f GiB, %.2f GiB of it held back for CUDA graphs; the KV cache gets %.0f%% "
        "of the rest: %.2f GiB",
        free / 2**30,
        total / 2**30,
        graph_pool_bytes / 2**30,
        memory_fraction * 100,
        budget / 2**30,
    )
    return budget


def kv_cache_budget(free_bytes: int, memory_fraction: float, graph_pool_bytes: int) -> int:
    """`memory_fraction` of what is free once the graphs' pool is set aside (0 when the pool takes it all)."""
    return int(max(0, free_bytes - graph_pool_bytes) * memory_fraction)
