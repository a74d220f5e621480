# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Rotary embedding and the KV-cache write in one pass: q is rotated in place, k is rotated on its way into the
paged cache, v is copied there. The reference composes `apply_rotary_reference` and `store_kv_reference`.

Why fused: in a decode step both are tiny (one token per sequence) and their cost is two launches per layer, not
bytes; one kernel saves a launch and a round trip of k through memory.
"""

import torch
import triton
import triton.language as tl

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel
from tidal.kernels.kv_cache import _check_inputs as _check_store_inputs
from tidal.kernels.kv_cache import store_kv_reference
from tidal.kernels.rotary import _check_inputs as _check_rotary_inputs
from tidal.kernels.rotary import _cos_sin, _rotate_heads, apply_rotary_reference


def rotary_store_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, num_heads, head_dim] rotated in place and returned; k/v [T, num_kv_heads, head_dim] (k rotated) written
    at slot_mapping [T] of the caches (slot -1: not written). k itself may be left rotated or not."""
    apply_rotary_reference(q, k, positions, cos_sin_cache, is_neox)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cos_sin_stride,
    num_heads,
    num_kv_heads,
    head_dim,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    let_next_kernel_launch(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, positions_ptr, token, cos_sin_stride, HALF, HALF_P2)
    q_row = q_ptr + token * q_stride_t
    _rotate_heads(q_row, q_row, q_stride_h, q_stride_h, num_heads, cos, sin, HALF, HALF_P2, BLOCK_HQ, IS_NEOX)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k_row = k_ptr + token * k_stride_t
        cache_row = slot * num_kv_heads * head_dim  # cache rows are dense [heads, head_dim]
        # k goes in rotated; v, and the dims of k past the rotary part, go over unchanged.
        heads = tl.arange(0, BLOCK_HK)[:, None]  # [BLOCK_HK, 1]
        dims = tl.arange(0, HEAD_DIM_P2)[None, :]  # [1, HEAD_DIM_P2]
        dim_ok = (heads < num_kv_heads) & (dims < head_dim)
        dest = cache_row + heads * head_dim + dims
        v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=dim_ok)
        tl.store(v_cache_ptr + dest, v, mask=dim_ok)
        tail_ok = dim_ok & (dims >= 2 * HALF)
        tl.store(k_cache_ptr + dest, tl.load(k_row + heads * k_stride_h + dims, mask=tail_ok), mask=tail_ok)
        _rotate_heads(
            k_row, k_cache_ptr + cache_row, k_stride_h, head_dim, num_kv_heads, cos, sin, HALF, HALF_P2, BLOCK_HK,
            IS_NEOX,
        )  # fmt: skip


def rotary_store_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The Triton kernel; same contract as the reference (k is left as it came: only its cache rows are rotated)."""
    _check_rotary_inputs(q, k, positions, cos_sin_cache)
    _check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q
    half = cos_sin_cache.shape[1] // 2
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, head_dim,
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox,
        num_warps=4,
        **pdl_launch_options(q.device),
    )  # fmt: skip
    return q


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere. -> q, rotated in place."""
    fused = rotary_store_kv_triton if q.is_cuda else rotary_store_kv_reference
    return fused(q, k, v, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping)
