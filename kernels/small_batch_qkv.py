"""The attention's input projection at small batch with the rotary embedding and the KV-cache write in its epilogue:
the torch reference and the Triton kernel's wrapper.

`small_batch_linear.linear_rows` computes a tile of consecutive outputs; here a program computes the two halves of a
rotary pair instead (dims i and i + D/2 of one head, the rotate_half convention of Llama, Mistral and Qwen2), so the
rotation needs no other program's outputs. q comes back rotated; k (rotated) and v go straight into the paged cache,
and the separate rotary+store kernel is not launched. Models that normalise q and k per head first (Qwen3: that
kernel applies the norm), rotate only part of a head, or pair adjacent dims (GPT-J) keep it: `can_fuse_rotary` says
which.
"""

import torch
import triton

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._small_batch_kernels import qkv_rope_kernel
from tidal.kernels._validate import INDEX_DTYPES, check_contiguous, check_dtype, check_shape
from tidal.kernels.rotary_store_kv import rotary_store_kv_reference
from tidal.kernels.small_batch_linear import MAX_ROWS, linear_rows_reference


def can_fuse_rotary(head_dim: int, rotary_dim: int, is_neox: bool, has_qk_norm: bool) -> bool:
    return is_neox and rotary_dim == head_dim and head_dim % 2 == 0 and not has_qk_norm


def _check(
    a: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> int:
    """-> head_dim."""
    if a.dim() != 2 or a.shape[0] > MAX_ROWS:
        raise ValueError(f"a must be [rows <= {MAX_ROWS}, K], got shape {tuple(a.shape)}")
    head_dim = k_cache.shape[-1]
    check_shape("k_cache", k_cache, (None, None, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_shape("weight", weight, ((num_q_heads + 2 * num_kv_heads) * head_dim, a.shape[1]))
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    check_contiguous("cos_sin_cache", cos_sin_cache)
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_shape(name, t, (a.shape[0],))
        check_dtype(name, t, INDEX_DTYPES)
    return head_dim


def qkv_rope_store_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_partials: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """-> q [M, Hq, D] rotated; k rotated and v written into the caches at slot_mapping (-1: not written). The
    projection is `linear_rows` (RMSNorm folded in when norm_partials is given)."""
    head_dim = _check(a, weight, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    qkv = linear_rows_reference(a, weight, bias, norm_partials, eps)  # [M, (Hq + 2 Hkv) * D]
    q, k, v = torch.split(qkv, [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.reshape(-1, num_q_heads, head_dim).clone()
    k = k.reshape(-1, num_kv_heads, head_dim).clone()
    v = v.reshape(-1, num_kv_heads, head_dim)
    return rotary_store_kv_reference(q, k, v, positions, cos_sin_cache, True, k_cache, v_cache, slot_mapping)


def qkv_rope_store_triton(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_partials: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    block_k: int = 256,
    num_stages: int = 4,
) -> torch.Tensor:
    """The Triton kernel; same contract as `qkv_rope_store_reference`."""
    head_dim = _check(a, weight, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    num_rows, k_in = a.shape
    q = torch.empty((num_rows, num_q_heads, head_dim), dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return q
    half = head_dim // 2
    block_n = 32 if half >= 32 else 16  # a tensor-core tile is at least 16 wide; lanes past the half are masked
    tiles_per_half = triton.cdiv(half, block_n)
    grid = ((num_q_heads + 2 * num_kv_heads) * tiles_per_half,)
    qkv_rope_kernel[grid](
        a, weight, bias if bias is not None else weight, norm_partials if norm_partials is not None else a,
        positions, cos_sin_cache, slot_mapping, q, k_cache, v_cache,
        num_rows, k_in, a.stride(0), weight.stride(0), norm_partials.shape[0] if norm_partials is not None else 0,
        eps, cos_sin_cache.stride(0), num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        TILES_PER_HALF=tiles_per_half,
        ROW_SCALE=norm_partials is not None,
        HAS_BIAS=bias is not None,
        IS_FP32=a.dtype == torch.float32,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k_in))),
        BLOCK_P=64,
        num_warps=4,
        num_stages=num_stages,
        **pdl_launch_options(a.device),
    )  # fmt: skip
    return q
