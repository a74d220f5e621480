# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Rotary embedding and the KV-cache write in one pass: q is rotated in place, k is rotated on its way into the
paged cache, v is copied there. The reference composes `apply_rotary_reference` and `store_kv_reference`.

Why fused: in a decode step both are tiny (one token per sequence) and their cost is two launches per layer, not
bytes; one kernel saves a launch and a round trip of k through memory. Qwen3's per-head RMSNorm of q and k
(`HeadNorm`) folds in the same way: the program already holds whole heads, so the two norm launches per layer go too.
"""

from typing import NamedTuple, cast

import torch
import triton
import triton.language as tl

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._triton_utils import for_cache, let_next_kernel_launch, v_slot_offset, wait_for_previous_kernel
from tidal.kernels._validate import FLOAT_DTYPES, check_contiguous, check_dtype, check_shape
from tidal.kernels.kv_cache import _check_inputs as _check_store_inputs
from tidal.kernels.kv_cache import store_kv_reference
from tidal.kernels.kv_layout import cache_strides
from tidal.kernels.rms_norm import rms_norm_reference
from tidal.kernels.rotary import _check_inputs as _check_rotary_inputs
from tidal.kernels.rotary import _cos_sin, _rotate_heads, apply_rotary_reference


class HeadNorm(NamedTuple):
    """An RMSNorm over each head's head_dim, applied before the rotation (Qwen3's q/k norm)."""

    gamma: torch.Tensor  # [head_dim]
    eps: float


def check_head_norms(head_dim: int, q_norm: HeadNorm | None, k_norm: HeadNorm | None) -> bool:
    """-> whether q and k are normalised (a model normalises both or neither)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: pass both or neither")
    for name, norm in (("q_norm.gamma", q_norm), ("k_norm.gamma", k_norm)):
        if norm is not None:
            check_shape(name, norm.gamma, (head_dim,))
            check_dtype(name, norm.gamma, FLOAT_DTYPES)
            check_contiguous(name, norm.gamma)
    return q_norm is not None


def _norm_heads_reference(x: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """x [T, heads, head_dim] -> a new tensor, each head normalised as the separate RMSNorm writes it."""
    num_tokens, num_heads, head_dim = x.shape
    normed = rms_norm_reference(x.reshape(num_tokens * num_heads, head_dim), norm.gamma, norm.eps)
    return cast(torch.Tensor, normed).view(x.shape)  # one tensor: no residual was given


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
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> torch.Tensor:
    """q [T, num_heads, head_dim] rotated in place and returned; k/v [T, num_kv_heads, head_dim] (k rotated) written
    at slot_mapping [T] of the caches (slot -1: not written). k itself may be left rotated or not. With the norms,
    each head of q and k is RMS-normalised over its whole head_dim first (q comes back normalised and rotated; the
    dims past the rotary part normalised only)."""
    if check_head_norms(q.shape[2], q_norm, k_norm):
        q.copy_(_norm_heads_reference(q, cast(HeadNorm, q_norm)))
        k = _norm_heads_reference(k, cast(HeadNorm, k_norm))
    apply_rotary_reference(q, k, positions, cos_sin_cache, is_neox)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _norm_rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride_h,
    dst_stride_h,
    num_heads,
    head_dim,
    gamma_ptr,
    eps,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    TAIL_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """`_rotate_heads` with an RMSNorm over each whole head first: fp32, times gamma, rounded to the source's dtype
    as the separate RMSNorm kernel writes it, then rotated. The tail past 2*HALF goes to `dst_ptr` normalised only."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    pairs = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    tail = 2 * HALF + tl.arange(0, TAIL_P2)[None, :]  # [1, TAIL_P2]
    pair_ok, tail_ok = pairs < HALF, tail < head_dim
    mask, tail_mask = (heads < num_heads) & pair_ok, (heads < num_heads) & tail_ok
    if IS_NEOX:
        first, second = pairs, HALF + pairs
    else:
        first, second = 2 * pairs, 2 * pairs + 1
    src, dst = src_ptr + heads * src_stride_h, dst_ptr + heads * dst_stride_h
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF_P2]
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    xt = tl.load(src + tail, mask=tail_mask, other=0.0).to(tl.float32)  # [BLOCK_H, TAIL_P2]
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xt * xt, axis=1)  # [BLOCK_H]
    inv_rms = tl.rsqrt(sum_sq / head_dim + eps)[:, None]  # [BLOCK_H, 1]
    g1 = tl.load(gamma_ptr + first, mask=pair_ok, other=0.0).to(tl.float32)  # [1, HALF_P2]
    g2 = tl.load(gamma_ptr + second, mask=pair_ok, other=0.0).to(tl.float32)
    gt = tl.load(gamma_ptr + tail, mask=tail_ok, other=0.0).to(tl.float32)  # [1, TAIL_P2]
    normed_ty = src_ptr.dtype.element_ty
    x1 = (x1 * inv_rms * g1).to(normed_ty).to(tl.float32)
    x2 = (x2 * inv_rms * g2).to(normed_ty).to(tl.float32)
    # dst: q's row (src's dtype) or k's cache row (src's dtype or FP8).
    tl.store(dst + tail, for_cache(xt * inv_rms * gt, dst_ptr, src_ptr), mask=tail_mask)
    tl.store(dst + first, for_cache(x1 * cos - x2 * sin, dst_ptr, src_ptr), mask=mask)
    tl.store(dst + second, for_cache(x2 * cos + x1 * sin, dst_ptr, src_ptr), mask=mask)


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
    q_gamma_ptr,
    k_gamma_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cos_sin_stride,
    v_cache_stride_block,
    v_cache_stride_offset,
    v_cache_stride_head,
    v_cache_stride_dim,
    num_heads,
    num_kv_heads,
    head_dim,
    q_eps,
    k_eps,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    TAIL_P2: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    let_next_kernel_launch(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, positions_ptr, token, cos_sin_stride, HALF, HALF_P2)
    q_row = q_ptr + token * q_stride_t
    if HAS_QK_NORM:
        _norm_rotate_heads(
            q_row, q_row, q_stride_h, q_stride_h, num_heads, head_dim, q_gamma_ptr, q_eps, cos, sin, HALF, HALF_P2,
            TAIL_P2, BLOCK_HQ, IS_NEOX,
        )  # fmt: skip
    else:
        _rotate_heads(q_row, q_row, q_stride_h, q_stride_h, num_heads, cos, sin, HALF, HALF_P2, BLOCK_HQ, IS_NEOX)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k_row = k_ptr + token * k_stride_t
        cache_row = slot * num_kv_heads * head_dim  # K's rows are dense [heads, head_dim]
        # k goes in rotated; v, and the dims of k past the rotary part, go over unchanged (k's normalised if asked).
        heads = tl.arange(0, BLOCK_HK)[:, None]  # [BLOCK_HK, 1]
        dims = tl.arange(0, HEAD_DIM_P2)[None, :]  # [1, HEAD_DIM_P2]
        dim_ok = (heads < num_kv_heads) & (dims < head_dim)
        dest = cache_row + heads * head_dim + dims
        v_dest = (v_slot_offset(slot, v_cache_stride_block, v_cache_stride_offset, BLOCK_SIZE)
                  + heads * v_cache_stride_head + dims * v_cache_stride_dim)  # fmt: skip
        v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=dim_ok).to(tl.float32)
        tl.store(v_cache_ptr + v_dest, for_cache(v, v_cache_ptr, v_ptr), mask=dim_ok)
        if HAS_QK_NORM:
            _norm_rotate_heads(
                k_row, k_cache_ptr + cache_row, k_stride_h, head_dim, num_kv_heads, head_dim, k_gamma_ptr, k_eps, cos,
                sin, HALF, HALF_P2, TAIL_P2, BLOCK_HK, IS_NEOX,
            )  # fmt: skip
        else:
            tail_ok = dim_ok & (dims >= 2 * HALF)
            k_tail = tl.load(k_row + heads * k_stride_h + dims, mask=tail_ok).to(tl.float32)
            tl.store(k_cache_ptr + dest, for_cache(k_tail, k_cache_ptr, k_ptr), mask=tail_ok)
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
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> torch.Tensor:
    """The Triton kernel; same contract as the reference (k is left as it came: only its cache rows are rotated)."""
    _check_rotary_inputs(q, k, positions, cos_sin_cache)
    _check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    has_qk_norm = check_head_norms(q.shape[2], q_norm, k_norm)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q
    half = cos_sin_cache.shape[1] // 2
    # Without the norms the gamma pointers are never read; q stands in for them.
    q_gamma, q_eps = (q_norm.gamma, q_norm.eps) if q_norm is not None else (q, 0.0)
    k_gamma, k_eps = (k_norm.gamma, k_norm.eps) if k_norm is not None else (q, 0.0)
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_gamma, k_gamma,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *cache_strides(v_cache), num_heads, num_kv_heads, head_dim, q_eps, k_eps,
        BLOCK_SIZE=k_cache.shape[1],
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        TAIL_P2=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox,
        HAS_QK_NORM=has_qk_norm,
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
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere. -> q, (normalised and) rotated in place."""
    fused = rotary_store_kv_triton if q.is_cuda else rotary_store_kv_reference
    return fused(q, k, v, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping, q_norm, k_norm)
