# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Writing new K/V rows into the paged cache: the torch reference, the Triton kernel and the dispatching entry point.

Cache layout (per layer): [num_blocks, block_size, num_kv_heads, head_dim], V possibly as a tokens-innermost view
(kernels/kv_layout.py); a token's slot is block_id * block_size + offset; slot -1 marks a padding token that is not
written. The cache holds the activations' dtype or FP8 e4m3 (kernels/kv_cache_dtype.py).
"""

import torch
import triton
import triton.language as tl

from tidal.kernels._triton_utils import for_cache, v_slot_offset
from tidal.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
)
from tidal.kernels.kv_cache_dtype import check_cache_dtype, to_cache_dtype
from tidal.kernels.kv_layout import cache_strides, check_kv_layouts


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_ndim("k_cache", k_cache, 4)
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("k", k, (None, num_kv_heads, head_dim))
    check_shape("v", v, tuple(k.shape))
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_dtype("k", k, FLOAT_DTYPES)
    check_same_dtype("k and v", k, v)
    check_cache_dtype("k_cache and v_cache", k.dtype, k_cache, v_cache)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_same_device("k, v, k_cache, v_cache and slot_mapping", k, v, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    check_kv_layouts(k_cache, v_cache)


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, num_kv_heads, head_dim] written in place at slot_mapping [T]; slots < 0 are skipped."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()  # [T_kept]
    blocks, offsets = slots // block_size, slots % block_size  # indexing both keeps V's view (no reshaped copy)
    k_cache[blocks, offsets] = to_cache_dtype(k[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v[keep], v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    v_cache_stride_block,
    v_cache_stride_offset,
    v_cache_stride_head,
    v_cache_stride_dim,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k_dest = slot * num_kv_heads * head_dim + heads * head_dim + dims  # K's rows are dense [heads, head_dim]
    v_dest = v_slot_offset(slot, v_cache_stride_block, v_cache_stride_offset, BLOCK_SIZE) + heads * v_cache_stride_head
    k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask).to(tl.float32)
    tl.store(k_cache_ptr + k_dest, for_cache(k, k_cache_ptr, k_ptr), mask=mask)
    tl.store(v_cache_ptr + v_dest + dims * v_cache_stride_dim, for_cache(v, v_cache_ptr, v_ptr), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The Triton kernel; same contract as `store_kv_reference`. Slots must lie inside the cache (not checked: that
    would need a device sync)."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # About 4K elements per program: enough bytes in flight without spilling for wide heads.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(4096 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *cache_strides(v_cache),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton on CUDA, the torch reference elsewhere."""
    if k.is_cuda:
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
