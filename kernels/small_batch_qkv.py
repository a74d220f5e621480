"""The attention's input projection at small batch with the rotary embedding and the KV-cache write in its epilogue:
the torch reference and the Triton kernel's wrapper.

`small_batch_linear.linear_rows` computes a tile of consecutive outputs; here a program computes the two halves of a
rotary pair instead (dims i and i + D/2 of one head, the rotate_half convention of Llama, Mistral and Qwen2), so the
rotation needs no other program's outputs. q comes back rotated; k (rotated) and v go straight into the paged cache,
and the separate rotary+store kernel is not launched. A per-head q/k norm (Qwen3, `HeadNorm`) folds in too: then a
program holds a whole head (one tile per half) and normalises q and k heads before rotating them, rounding as the
rotary+store kernel does. Whole heads make few programs (Qwen3-30B-A3B: 40), so K is split over more of them
(`default_split_k`; the last split to arrive adds the partials, see _split_k.py). Models that rotate only part of a
head or pair adjacent dims (GPT-J) keep the separate kernel: `can_fuse_rotary` says which.
"""

import math
from typing import Literal

import torch
import triton

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._one_row_kernels import one_row_qkv_kernel
from tidal.kernels._small_batch_kernels import qkv_rope_kernel
from tidal.kernels._split_k import split_buffers
from tidal.kernels._validate import INDEX_DTYPES, check_contiguous, check_dtype, check_shape
from tidal.kernels.kv_cache_dtype import check_cache_dtype
from tidal.kernels.kv_layout import cache_strides, check_kv_layouts
from tidal.kernels.rotary_store_kv import HeadNorm, check_head_norms, rotary_store_kv_reference
from tidal.kernels.small_batch_linear import MAX_ROWS, OneRowConfig, check_weight_scale, linear_rows_reference

# Half-head widths a whole-head program takes as one tile: a tensor-core tile is a power of two of at least 16; wider
# than 128, its two fp32 accumulators of 16 rows would crowd the registers (no supported family has such heads).
# So head_dim 32, 64, 128 or 256.
WHOLE_HEAD_HALVES = (16, 32, 64, 128)

# A whole-head launch's defaults, measured on an H200 for Qwen3-30B-A3B's qkv with its q/k norms at one row. Alone
# (bench_small_batch_linear.py --sweep --shape qwen3-30b-a3b-qkv-rope, 48 layers' weights in a graph) its 40
# whole-head programs split in 4 by 64 inputs a step at 8 warps took 10.32 us, split in 2 by 128 at 4 warps 10.88 us;
# but inside the decode step (profile_steps.py, batch 1) the first made the step slower, 3,128 us against 3,017: the
# step's figure decides. So: splits for 80 programs, 128 inputs a step (by a 64-wide tile pair), 4 warps.
MIN_PROGRAMS = 80
WHOLE_HEAD_STEP_ELEMENTS = 8192  # block_n x block_k of one of the program's two tiles
WHOLE_HEAD_WARPS = 4
# Timed for head_dim 128 only (no supported family has wider heads with a q/k norm). At 256 these defaults give
# 128-wide tiles by 64 inputs a step; compiled for sm_90 the program uses 104 registers and spills none (92 at
# head_dim 128; benchmarks/kernels/register_report.py, register-report-sm90.txt), so it runs, at a speed no one
# has measured.

# Half-head launches keep these defaults on e4m3 weights too. Alone, the 8B's qkv at one row took 13.56 us with the
# whole half a program, 256 inputs a step and K split in two, against 14.50 on the defaults (H100, 32 layers' weights
# in a graph: bench_small_batch_linear.py --sweep --shape llama3-8b-qkv-rope --weight-dtype fp8); inside the decode
# step (profile_steps.py) it made batch 1 3,743-3,755 us against 3,727 and batch 8 3,891-3,926 against 3,831.


# Shapes where one row takes the row GEMV (`one_row_qkv_kernel`) rather than the tiled kernel, by (query heads, KV
# heads, head_dim, inputs, q/k norm, e4m3 weights): benchmarks/kernels/probe_row_gemv.py prints an entry where a
# config beats the tiled launch alone; one is added only once the decode step (profile_steps.py) gains from it too,
# because the tiled launch's defaults above were chosen by the step and not by the kernel alone.
# Qwen3-30B-A3B's FP8 qkv (q/k norms) on an H200: alone 6.86 us against 8.64 for the tiled launch, 2 dims of each half a
# program (32 programs a head meeting on the counter); in the FP8 decode step at batch 1, context 160, the step took
# 2,237 us against 2,455, and 2,422 again without it (profile-steps-qwen3-30b-a3b-h200-one-row-qkv-ab.txt). Its
# bf16 qkv: alone 9.22 us against 10.98, the bf16 step 2,819 us against 2,947. Both load their weights before the
# wait (`weights_first`), so the rows stream while the previous kernel ends; the FP8 one at 4 dims a program over 4
# warps (see TUNED_ONE_ROW_CONFIGS for the step's A/B; the bf16 step 3,391 us against 3,441, within its noise).
TUNED_ONE_ROW_QKV_CONFIGS: dict[tuple[int, int, int, int, bool, bool], OneRowConfig] = {
    (32, 4, 128, 2048, True, True): OneRowConfig(4, 1024, 4, weights_first=True),
    (32, 4, 128, 2048, True, False): OneRowConfig(2, 1024, 4, weights_first=True),
}


def choose_one_row_qkv_config(
    num_q_heads: int, num_kv_heads: int, head_dim: int, k_in: int, qk_norm: bool, fp8_weights: bool
) -> OneRowConfig | None:
    """The row GEMV's config for a one-row qkv of this shape, or None: the tiled kernel."""
    return TUNED_ONE_ROW_QKV_CONFIGS.get((num_q_heads, num_kv_heads, head_dim, k_in, qk_norm, fp8_weights))


def can_fuse_rotary(head_dim: int, rotary_dim: int, is_neox: bool, has_qk_norm: bool) -> bool:
    if not (is_neox and rotary_dim == head_dim and head_dim % 2 == 0):
        return False
    return not has_qk_norm or head_dim // 2 in WHOLE_HEAD_HALVES


def default_split_k(num_tiles: int, k_steps: int, whole_heads: bool) -> int:
    """Splits of K per tile: for whole heads, enough that num_tiles * split reaches MIN_PROGRAMS, and no more than K
    has BLOCK_K steps (a split with no K only adds a partial of zeros). Half-head tiles stay unsplit: their launch
    was measured that way, and they are already two or more programs per head."""
    if not whole_heads or num_tiles >= MIN_PROGRAMS:
        return 1
    return max(1, min(math.ceil(MIN_PROGRAMS / num_tiles), k_steps))


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
    weight_scale: torch.Tensor | None,
) -> int:
    """-> head_dim."""
    if a.dim() != 2 or a.shape[0] > MAX_ROWS:
        raise ValueError(f"a must be [rows <= {MAX_ROWS}, K], got shape {tuple(a.shape)}")
    head_dim = k_cache.shape[-1]
    check_shape("k_cache", k_cache, (None, None, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_kv_layouts(k_cache, v_cache)
    check_cache_dtype("k_cache and v_cache", a.dtype, k_cache, v_cache)
    check_shape("weight", weight, ((num_q_heads + 2 * num_kv_heads) * head_dim, a.shape[1]))
    check_weight_scale(a, weight, weight_scale)
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
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> q [M, Hq, D] (normalised per head with q_norm, then) rotated; k (normalised with k_norm, then rotated) and
    v written into the caches at slot_mapping (-1: not written). The projection is `linear_rows` (RMSNorm folded in
    when norm_partials is given), its output rounded to a's dtype as the unfused layer's is. `weight_scale`: an e4m3
    weight's per-row scales."""
    head_dim = _check(
        a, weight, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, weight_scale
    )
    qkv = linear_rows_reference(a, weight, bias, norm_partials, eps, weight_scale=weight_scale)  # [M, (Hq+2Hkv)*D]
    q, k, v = torch.split(qkv, [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.reshape(-1, num_q_heads, head_dim).clone()
    k = k.reshape(-1, num_kv_heads, head_dim).clone()
    v = v.reshape(-1, num_kv_heads, head_dim)
    return rotary_store_kv_reference(
        q, k, v, positions, cos_sin_cache, True, k_cache, v_cache, slot_mapping, q_norm, k_norm
    )


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
    q_norm: HeadNorm | None = None,
    k_norm: HeadNorm | None = None,
    split_k: int | None = None,
    block_k: int | None = None,
    num_stages: int = 4,
    num_warps: int | None = None,
    weight_scale: torch.Tensor | None = None,
    block_n: int | None = None,
    one_row: OneRowConfig | Literal["tuned", "off"] = "tuned",
) -> torch.Tensor:
    """The Triton kernel; same contract as `qkv_rope_store_reference`. split_k: None takes `default_split_k`;
    block_k and num_warps: None take the measured defaults (whole heads: see MIN_PROGRAMS; half heads: the 32 x 256
    tile at 4 warps). block_n: dims of each half a program takes (a power of two of at least 16, at most the half's
    next power of two; None: the half with a q/k norm, which needs whole heads, else 32, or 16 for narrower
    halves). one_row: a `OneRowConfig` launches the row GEMV (one row only); "tuned" does where
    TUNED_ONE_ROW_QKV_CONFIGS lists a one-row launch's shape and no tiled parameter is given; "off" never does."""
    head_dim = _check(
        a, weight, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, weight_scale
    )
    qk_norm = check_head_norms(head_dim, q_norm, k_norm)
    half = head_dim // 2
    if qk_norm and half not in WHOLE_HEAD_HALVES:
        raise ValueError(f"a q/k norm needs head_dim 2 * {WHOLE_HEAD_HALVES}, got {head_dim}")
    widest = max(16, triton.next_power_of_2(half))
    if block_n is not None and (block_n & (block_n - 1) or not 16 <= block_n <= widest):
        raise ValueError(f"block_n must be a power of two from 16 to {widest} (the half-head), got {block_n}")
    if qk_norm and block_n not in (None, half):
        raise ValueError(f"a q/k norm takes whole heads: block_n must be the half-head {half}, got {block_n}")
    num_rows, k_in = a.shape
    q = torch.empty((num_rows, num_q_heads, head_dim), dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return q
    # Without the norms the gamma pointers are never read; the weight stands in for them.
    q_gamma, q_eps = (q_norm.gamma, q_norm.eps) if q_norm is not None else (weight, 0.0)
    k_gamma, k_eps = (k_norm.gamma, k_norm.eps) if k_norm is not None else (weight, 0.0)
    num_partials = norm_partials.shape[0] if norm_partials is not None else 0
    pointers = (
        a, weight, weight_scale if weight_scale is not None else cos_sin_cache,  # the scales: never read without FP8
        bias if bias is not None else weight, norm_partials if norm_partials is not None else a,
        positions, cos_sin_cache, slot_mapping, q, k_cache, v_cache, q_gamma, k_gamma,
    )  # fmt: skip
    shared = {
        "HEAD_DIM": head_dim,
        "HALF": half,
        "BLOCK_SIZE": k_cache.shape[1],
        "ROW_SCALE": norm_partials is not None,
        "HAS_BIAS": bias is not None,
        "QK_NORM": qk_norm,
        **pdl_launch_options(a.device),
    }
    row_config = one_row if isinstance(one_row, OneRowConfig) else None
    if one_row == "tuned" and num_rows == 1 and (split_k, block_k, num_warps, block_n) == (None, None, None, None):
        fp8 = weight_scale is not None
        row_config = choose_one_row_qkv_config(num_q_heads, num_kv_heads, head_dim, k_in, qk_norm, fp8)
    if row_config is not None:
        # The row GEMV (`one_row_qkv_kernel`): `block_n` dims of both halves of a head a program, its rows streamed
        # whole; with a q/k norm the head's programs meet on an arrival counter and the last finishes the head.
        if num_rows != 1:
            raise ValueError(f"a one-row config launches one row, got {num_rows}")
        row_n = row_config.block_n
        if row_n & (row_n - 1) or not 1 <= row_n <= triton.next_power_of_2(half):
            raise ValueError(f"block_n must be a power of two of at most the half-head {half}, got {row_n}")
        num_heads = num_q_heads + 2 * num_kv_heads
        programs_per_head = triton.cdiv(half, row_n)
        # With a q/k norm each head's values meet in the workspace (one fp32 row of head_dim a head).
        splits = programs_per_head if qk_norm else 1
        workspace, counters = split_buffers(q, num_heads, splits, head_dim // splits)
        one_row_qkv_kernel[(num_heads * programs_per_head,)](
            *pointers, workspace, counters, k_in, weight.stride(0), num_partials, eps, q_eps, k_eps,
            cos_sin_cache.stride(0), num_q_heads, num_kv_heads, *cache_strides(v_cache), **shared,
            PROGRAMS_PER_HEAD=programs_per_head,
            BLOCK_N=row_n,
            BLOCK_K=row_config.launch_block_k(k_in, 2 * row_n, weight.element_size()),
            BLOCK_P=min(1024, max(16, triton.next_power_of_2(num_partials))),
            WEIGHTS_FIRST=row_config.weights_first,
            num_warps=row_config.num_warps,
        )  # fmt: skip
        return q
    # A q/k norm needs the whole head in one program. Otherwise 32 or 16 of a half: a tensor-core tile is at least 16
    # wide, and lanes past the half are masked.
    if block_n is None:
        block_n = half if qk_norm else (32 if half >= 32 else 16)
    if block_k is None:
        block_k = WHOLE_HEAD_STEP_ELEMENTS // block_n if qk_norm else 8192 // max(block_n, 32)
    if num_warps is None:
        num_warps = WHOLE_HEAD_WARPS if qk_norm else 4
    block_k = min(block_k, max(16, triton.next_power_of_2(k_in)))
    tiles_per_half = triton.cdiv(half, block_n)
    num_tiles = (num_q_heads + 2 * num_kv_heads) * tiles_per_half
    if split_k is None:
        split_k = default_split_k(num_tiles, triton.cdiv(k_in, block_k), qk_norm)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    workspace, counters = split_buffers(q, num_tiles, split_k, 2 * MAX_ROWS * block_n)  # a rotary pair's tiles
    qkv_rope_kernel[(num_tiles, split_k)](
        *pointers, workspace, counters, num_rows, k_in, a.stride(0), weight.stride(0), num_partials, eps, q_eps, k_eps,
        cos_sin_cache.stride(0), num_q_heads, num_kv_heads, *cache_strides(v_cache), **shared,
        TILES_PER_HALF=tiles_per_half,
        IS_FP32=a.dtype == torch.float32,
        SPLIT_K=split_k,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_P=64,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return q
