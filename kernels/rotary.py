# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Rotary position embedding: the cos/sin cache (default, linear and Llama-3 scaling), the torch reference rotation,
the Triton kernel and the dispatching entry point. Both rotation styles: neox (rotate halves) and GPT-J (pairs)."""

import math
from typing import Any

import torch
import triton
import triton.language as tl

from tidal.kernels._triton_utils import for_cache
from tidal.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_shape,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    # transformers writes "rope_type"; older configs wrote "type".
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by `factor`, short ones kept, the band between is
    interpolated linearly in 1/wavelength."""
    try:
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        original = float(rope_scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise ValueError(f"llama3 rope_scaling is missing {missing}") from None
    if high <= low:
        raise ValueError(f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    wavelen = 2 * math.pi / inv_freq  # [rotary_dim / 2]
    blend = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0 -> fully scaled, 1 -> untouched
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(in_band, (1 - blend) * inv_freq / factor + blend * inv_freq, scaled)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """-> [max_position, rotary_dim]: cos of the rotary_dim/2 frequencies, then their sin."""
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    rope_type = _rope_type(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # [rotary_dim / 2], fp32 like transformers
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)  # type: ignore[arg-type]
    positions = torch.arange(max_position, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [max_position, rotary_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    check_ndim("q", q, 3)
    check_dtype("q", q, FLOAT_DTYPES)
    check_shape("k", k, (q.shape[0], None, q.shape[2]))
    check_dtype("k", k, (q.dtype,))
    check_shape("positions", positions, (q.shape[0],))
    check_dtype("positions", positions, INDEX_DTYPES)
    check_ndim("cos_sin_cache", cos_sin_cache, 2)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 != 0 or rotary_dim > q.shape[2]:
        raise ValueError(f"cos_sin_cache width {rotary_dim} must be even and <= head_dim {q.shape[2]}")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, heads, rotary_dim] fp32, cos/sin [T, 1, rotary_dim / 2] -> rotated x."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # GPT-J: dims (2i, 2i+1) form a pair
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rotary_dim dims of q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] IN PLACE
    and returns (q, k)."""
    _check_inputs(q, k, positions, cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, rotary_dim]
    cos, sin = cos_sin[:, None, : rotary_dim // 2], cos_sin[:, None, rotary_dim // 2 :]  # [T, 1, rotary_dim / 2]
    for x in (q, k):
        x[..., :rotary_dim] = _rotate(x[..., :rotary_dim].float(), cos, sin, is_neox).to(x.dtype)
    return q, k


@triton.jit
def _cos_sin(cache_ptr, positions_ptr, token, cache_stride, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """cos and sin [1, HALF_P2] fp32 of `token`'s position (padding lanes 0)."""
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    row = cache_ptr + position * cache_stride
    cos = tl.load(row + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride_h,
    dst_stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotates the first 2*HALF dims of every head of one token from `src_ptr` (the token's row) into `dst_ptr`
    (the same row for an in-place rotation); cos/sin [1, HALF_P2] fp32. Other dims are not touched. A destination
    in an FP8 KV cache gets the rotated values as the cache stores them (`for_cache`)."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    pairs = tl.arange(0, HALF_P2)[None, :]  # [1, HALF_P2]
    mask = (heads < num_heads) & (pairs < HALF)
    if IS_NEOX:
        first, second = pairs, HALF + pairs
    else:
        first, second = 2 * pairs, 2 * pairs + 1
    src, dst = src_ptr + heads * src_stride_h, dst_ptr + heads * dst_stride_h
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, for_cache(x1 * cos - x2 * sin, dst_ptr, src_ptr), mask=mask)
    tl.store(dst + second, for_cache(x2 * cos + x1 * sin, dst_ptr, src_ptr), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cache_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(cache_ptr, positions_ptr, token, cache_stride, HALF, HALF_P2)
    q_row, k_row = q_ptr + token * q_stride_t, k_ptr + token * k_stride_t
    _rotate_heads(q_row, q_row, q_stride_h, q_stride_h, num_heads, cos, sin, HALF, HALF_P2, BLOCK_HQ, IS_NEOX)
    _rotate_heads(k_row, k_row, k_stride_h, k_stride_h, num_kv_heads, cos, sin, HALF, HALF_P2, BLOCK_HK, IS_NEOX)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same contract as `apply_rotary_reference` (in place, returns (q, k))."""
    _check_inputs(q, k, positions, cos_sin_cache)
    num_tokens, num_heads, _ = q.shape
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            positions,
            cos_sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            num_heads,
            k.shape[1],
            HALF=cos_sin_cache.shape[1] // 2,
            HALF_P2=triton.next_power_of_2(cos_sin_cache.shape[1] // 2),
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            IS_NEOX=is_neox,
            num_warps=4,
        )
    return q, k


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere. Rotates q and k in place and returns them."""
    if q.is_cuda:
        return apply_rotary_triton(q, k, positions, cos_sin_cache, is_neox)
    return apply_rotary_reference(q, k, positions, cos_sin_cache, is_neox)
