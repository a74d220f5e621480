# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the small-batch projections (wrappers: small_batch_linear, small_batch_qkv). One program computes
BLOCK_N outputs (or two tiles of BLOCK_N at a fixed distance: gate and up, or the two halves of a rotary pair) of every
row over K, or over its split's share of K with SPLIT_K > 1 (the last split to arrive adds them up), then runs its
epilogue."""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import (
    FP16_MAX,
    arrives_last,
    exact_dot,
    for_cache,
    let_next_kernel_launch,
    v_slot_offset,
    wait_for_previous_kernel,
)


@triton.jit
def _products(
    a_ptr,
    w_ptr,
    a_stride,
    w_stride,
    k_in,
    rows,
    row_mask,
    outs,
    out_mask,
    second_offset,
    PAIRED: tl.constexpr,
    IS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(a @ W[outs]^T, a @ W[outs + second_offset]^T when PAIRED), each [BLOCK_M, BLOCK_N] fp32. An e4m3 W (FP8
    weights, their scales left to the caller's epilogue) is multiplied in fp16 beside 16-bit activations: e4m3 converts
    to fp16 in one packed instruction (to bf16 it takes two), fp16 holds every e4m3 value exactly and a bf16 row more
    finely, clamped to fp16's range; in fp32 beside fp32 ones."""
    W_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        a = tl.load(a_ptr + rows[:, None] * a_stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_offsets = outs[:, None] * w_stride + ks[None, :]
        w_mask = out_mask[:, None] & k_mask[None, :]
        if W_FP8:
            a = beside_fp8(a, IS_FP32)
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0).to(a.dtype)  # [BLOCK_N, BLOCK_K]
        acc = exact_dot(a, tl.trans(w), IS_FP32, acc)
        if PAIRED:
            w2 = tl.load(w_ptr + second_offset * w_stride + w_offsets, mask=w_mask, other=0.0).to(a.dtype)
            acc2 = exact_dot(a, tl.trans(w2), IS_FP32, acc2)
    return acc, acc2


@triton.jit
def beside_fp8(a, IS_FP32: tl.constexpr):
    """Activations a in the type their products with e4m3 weights run in (see _products)."""
    if IS_FP32:
        return a
    else:
        return tl.clamp(a.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)


@triton.jit
def _weight_scales(w_scale_ptr, outs, out_mask, second_offset, W_SCALED: tl.constexpr, PAIRED: tl.constexpr):
    """[1, BLOCK_N] fp32 scales of the output channels `outs` (and of `outs + second_offset` when PAIRED) of FP8
    weights; ones otherwise (never read)."""
    if W_SCALED:
        scale = tl.load(w_scale_ptr + outs, mask=out_mask, other=1.0)[None, :]
        scale2 = scale
        if PAIRED:
            scale2 = tl.load(w_scale_ptr + second_offset + outs, mask=out_mask, other=1.0)[None, :]
    else:
        scale = tl.full((1, outs.shape[0]), 1.0, tl.float32)
        scale2 = scale
    return scale, scale2


@triton.jit
def _split_share(k_in, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """-> (first input, input count) of this program's split of K (grid axis 1): whole BLOCK_K steps each, so the last
    splits may get none (k_len <= 0: no loop step, their partials are zeros)."""
    k_share = tl.cdiv(tl.cdiv(k_in, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.program_id(1) * k_share
    return k_start, tl.minimum(k_in - k_start, k_share)


@triton.jit
def _inv_rms(partials_ptr, num_partials, num_rows, rows, row_mask, k_in, eps, BLOCK_M: tl.constexpr,
             BLOCK_P: tl.constexpr):  # fmt: skip
    """[BLOCK_M, 1] 1 / rms of each row from the partial sums of squares [num_partials, num_rows], added in order."""
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for p0 in range(0, num_partials, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        part_mask = (ps < num_partials)[:, None] & row_mask[None, :]
        sum_sq += tl.sum(tl.load(partials_ptr + ps[:, None] * num_rows + rows[None, :], mask=part_mask, other=0.0), 0)
    return tl.rsqrt(sum_sq / k_in + eps)[:, None]


@triton.jit
def _sum_splits_last(acc, acc_up, workspace_ptr, counters_ptr, tile, GATED: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Writes this split's partial tiles, counts the split in on the tile's counter, and -> (the sums over all splits
    in split order, the same for gate/up's second tile, whether this split arrived last). Only the last one's sums
    are complete; the others' loads are masked off and their epilogue stores must be too."""
    tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
    split = tl.program_id(1)
    cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_base = workspace_ptr + tile.to(tl.int64) * (SPLIT_K * 2 * tile_elems)
    tl.store(tile_base + split * (2 * tile_elems) + cell, acc)
    if GATED:
        tl.store(tile_base + split * (2 * tile_elems) + tile_elems + cell, acc_up)
    last = arrives_last(counters_ptr + tile, SPLIT_K)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        # .cg: from L2, where the other programs' stores are, never a stale L1 line.
        total += tl.load(tile_base + s * (2 * tile_elems) + cell, mask=last, other=0.0, cache_modifier=".cg")
        if GATED:
            total_up += tl.load(tile_base + s * (2 * tile_elems) + tile_elems + cell, mask=last, other=0.0,
                                cache_modifier=".cg")  # fmt: skip
    tl.store(counters_ptr + tile, 0, mask=last)  # ready for the next launch
    return total, total_up, last


@triton.jit
def linear_rows_kernel(
    a_ptr,  # [M, K]
    w_ptr,  # [N, K]; gated: gate rows [0, N_OUT), up rows [N_OUT, 2 N_OUT); 16-bit, fp32 or e4m3
    w_scale_ptr,  # [N] fp32 scales of an e4m3 W's rows (output channels)
    bias_ptr,  # [N] when HAS_BIAS
    norm_partials_ptr,  # [P_IN, M] fp32 when ROW_SCALE
    residual_ptr,  # [M, N_OUT] when INTO_RESIDUAL
    gamma_ptr,  # [N_OUT] when INTO_RESIDUAL
    y_ptr,  # [M, N_OUT]: the output, or the new residual when INTO_RESIDUAL
    scaled_ptr,  # [M, N_OUT] h * gamma when INTO_RESIDUAL
    partial_sq_ptr,  # [num programs, M] fp32 when INTO_RESIDUAL
    num_rows,
    n_out,
    k_in,
    a_stride,
    w_stride,
    residual_stride,
    num_partials_in,
    eps,
    workspace_ptr,  # [N-tiles, SPLIT_K, 2, BLOCK_M, BLOCK_N] fp32 when SPLIT_K > 1
    counters_ptr,  # [>= N-tiles] int32 arrival counters, zero between launches, when SPLIT_K > 1
    ROW_SCALE: tl.constexpr,
    GATED: tl.constexpr,
    INTO_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (N-tile, split): BLOCK_N outputs of every row over the split's share of K (all of it when SPLIT_K is
    1). With SPLIT_K > 1 the split that arrives last on its tile adds the partials and alone runs the epilogue, its
    stores masked by `finishes` (see _split_k.py)."""
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    out_mask = outs < n_out
    k_start, k_len = _split_share(k_in, SPLIT_K, BLOCK_K)
    # The epilogue's small inputs are loaded before the K loop: each is a dependent round trip to L2 or memory, which
    # here overlaps the weight stream instead of following it (at one row a projection of a few MB takes only a few
    # us, and every round trip after the loop adds to it).
    if ROW_SCALE:
        inv_rms = _inv_rms(norm_partials_ptr, num_partials_in, num_rows, rows, row_mask, k_in, eps, BLOCK_M, BLOCK_P)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            bias_up = tl.load(bias_ptr + n_out + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    w_scale, w_scale_up = _weight_scales(w_scale_ptr, outs, out_mask, n_out, w_ptr.dtype.element_ty == tl.float8e4nv,
                                         GATED)  # fmt: skip
    if INTO_RESIDUAL:
        res_mask = row_mask[:, None] & out_mask[None, :]
        res = tl.load(residual_ptr + rows[:, None] * residual_stride + outs[None, :], mask=res_mask, other=0.0)
        gamma = tl.load(gamma_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)
    acc, acc_up = _products(
        a_ptr + k_start, w_ptr + k_start, a_stride, w_stride, k_len, rows, row_mask, outs, out_mask, n_out, GATED,
        IS_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    let_next_kernel_launch(USE_PDL)  # its programs can settle in while this one runs its epilogue
    if SPLIT_K > 1:
        acc, acc_up, finishes = _sum_splits_last(acc, acc_up, workspace_ptr, counters_ptr, pid, GATED, SPLIT_K,
                                                 BLOCK_M, BLOCK_N)  # fmt: skip
        row_mask = row_mask & finishes  # every store below is the last split's alone
    if w_ptr.dtype.element_ty == tl.float8e4nv:
        acc = acc * w_scale
        acc_up = acc_up * w_scale_up
    if ROW_SCALE:
        acc = acc * inv_rms
        acc_up = acc_up * inv_rms
    if HAS_BIAS:
        acc += bias
        if GATED:
            acc_up += bias_up
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    y_mask = row_mask[:, None] & out_mask[None, :]
    y_offsets = rows[:, None] * n_out + outs[None, :]
    if INTO_RESIDUAL:
        # Rounded twice, as the unfused layer rounds: the projection's output, then the residual sum.
        h = (acc.to(y_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + y_offsets, h, mask=y_mask)
        hf = h.to(tl.float32)
        tl.store(scaled_ptr + y_offsets, (hf * gamma[None, :]).to(scaled_ptr.dtype.element_ty), mask=y_mask)
        tl.store(partial_sq_ptr + pid * num_rows + rows, tl.sum(hf * hf, axis=1), mask=row_mask)
    else:
        tl.store(y_ptr + y_offsets, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _norm_heads(x1, x2, dims, is_q, q_gamma_ptr, k_gamma_ptr, q_eps, k_eps, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm of the q or k head whose halves x1, x2 [BLOCK_M, HALF] this program holds: fp32 over
    the head, times that head's gamma, as rotary_store_kv's `_norm_rotate_heads` computes it (the caller rounds)."""
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_M]
    inv_rms = tl.rsqrt(sum_sq / HEAD_DIM + tl.where(is_q, q_eps, k_eps))[:, None]  # [BLOCK_M, 1]
    # Both gammas are loaded (a few hundred bytes) and the head's kept: no branch on a runtime value.
    second = dims + HEAD_DIM // 2
    g1 = tl.where(is_q, tl.load(q_gamma_ptr + dims), tl.load(k_gamma_ptr + dims)).to(tl.float32)[None, :]
    g2 = tl.where(is_q, tl.load(q_gamma_ptr + second), tl.load(k_gamma_ptr + second)).to(tl.float32)[None, :]
    return x1 * inv_rms * g1, x2 * inv_rms * g2


@triton.jit
def qkv_rope_kernel(
    a_ptr,  # [M, K]
    w_ptr,  # [(Hq + 2 Hkv) * D, K]: q heads, then k heads, then v heads; 16-bit, fp32 or e4m3
    w_scale_ptr,  # [(Hq + 2 Hkv) * D] fp32 scales of an e4m3 W's rows
    bias_ptr,  # [(Hq + 2 Hkv) * D] when HAS_BIAS
    norm_partials_ptr,  # [P_IN, M] fp32 when ROW_SCALE
    positions_ptr,  # [M]
    cos_sin_ptr,  # [max_position, D]: cos of the D/2 frequencies, then their sin
    slot_ptr,  # [M] cache slot of each row's k and v; -1: not written
    q_ptr,  # [M, Hq * D] rotated q out
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] (dense slots)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] at its strides (kernels/kv_layout.py)
    q_gamma_ptr,  # [D] q's per-head norm weight when QK_NORM
    k_gamma_ptr,  # [D] k's, when QK_NORM
    workspace_ptr,  # [programs along axis 0, SPLIT_K, 2, BLOCK_M, BLOCK_N] fp32 when SPLIT_K > 1
    counters_ptr,  # [>= programs along axis 0] int32 arrival counters, zero between launches, when SPLIT_K > 1
    num_rows,
    k_in,
    a_stride,
    w_stride,
    num_partials_in,
    eps,
    q_eps,
    k_eps,
    cos_sin_stride,
    num_q_heads,
    num_kv_heads,
    v_cache_stride_block,
    v_cache_stride_offset,
    v_cache_stride_head,
    v_cache_stride_dim,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILES_PER_HALF: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    IS_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (tile, split): BLOCK_N dims of the first half of one head and the same dims of its second half (a
    rotary pair, rotate_half style) over the split's share of K, so the rotation happens in the epilogue; q goes out,
    k and v straight into the cache. QK_NORM needs the whole head in one program (TILES_PER_HALF 1, BLOCK_N HALF) to
    normalise q and k heads before rotating them. With SPLIT_K > 1 the split that arrives last on its tile adds the
    partials and alone runs the epilogue, as in linear_rows_kernel."""
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    head = pid // TILES_PER_HALF
    dims = (pid % TILES_PER_HALF) * BLOCK_N + tl.arange(0, BLOCK_N)  # within the half
    dim_ok = dims < HALF
    outs = head * HEAD_DIM + dims
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    k_start, k_len = _split_share(k_in, SPLIT_K, BLOCK_K)
    # The epilogue's small inputs load before the K loop, their round trips overlapping the weight stream (as in
    # linear_rows_kernel).
    if ROW_SCALE:
        inv_rms = _inv_rms(norm_partials_ptr, num_partials_in, num_rows, rows, row_mask, k_in, eps, BLOCK_M, BLOCK_P)
    if HAS_BIAS:
        bias1 = tl.load(bias_ptr + outs, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
        bias2 = tl.load(bias_ptr + outs + HALF, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    positions = tl.load(positions_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    angles = cos_sin_ptr + positions[:, None] * cos_sin_stride + dims[None, :]
    cos = tl.load(angles, mask=row_mask[:, None] & dim_ok[None, :], other=1.0).to(tl.float32)
    sin = tl.load(angles + HALF, mask=row_mask[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    w_scale1, w_scale2 = _weight_scales(w_scale_ptr, outs, dim_ok, HALF, w_ptr.dtype.element_ty == tl.float8e4nv,
                                        True)  # fmt: skip
    x1, x2 = _products(
        a_ptr + k_start, w_ptr + k_start, a_stride, w_stride, k_len, rows, row_mask, outs, dim_ok, HALF, True,
        IS_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    let_next_kernel_launch(USE_PDL)
    if SPLIT_K > 1:
        x1, x2, finishes = _sum_splits_last(x1, x2, workspace_ptr, counters_ptr, pid, True, SPLIT_K, BLOCK_M,
                                            BLOCK_N)  # fmt: skip
        row_mask = row_mask & finishes  # every store below is the last split's alone
    if w_ptr.dtype.element_ty == tl.float8e4nv:
        x1 = x1 * w_scale1
        x2 = x2 * w_scale2
    if ROW_SCALE:
        x1 = x1 * inv_rms
        x2 = x2 * inv_rms
    if HAS_BIAS:
        x1 += bias1
        x2 += bias2
    # Rounded to the activations' dtype first, as the unfused projection's output is before its rotation.
    x1 = x1.to(q_ptr.dtype.element_ty).to(tl.float32)
    x2 = x2.to(q_ptr.dtype.element_ty).to(tl.float32)
    mask = row_mask[:, None] & dim_ok[None, :]
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads)
    if QK_NORM:
        n1, n2 = _norm_heads(x1, x2, dims, is_q, q_gamma_ptr, k_gamma_ptr, q_eps, k_eps, HEAD_DIM)
        # Rounded again, as the separate norm's output is before its rotation; v is not normalised.
        x1 = tl.where(is_v, x1, n1.to(q_ptr.dtype.element_ty).to(tl.float32))
        x2 = tl.where(is_v, x2, n2.to(q_ptr.dtype.element_ty).to(tl.float32))
    y1 = tl.where(is_v, x1, x1 * cos - x2 * sin)
    y2 = tl.where(is_v, x2, x2 * cos + x1 * sin)
    q_out = q_ptr + rows[:, None] * (num_q_heads * HEAD_DIM) + outs[None, :]
    tl.store(q_out, y1.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(q_out + HALF, y2.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    dest = slots[:, None] * (num_kv_heads * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
    kv_mask = mask & (slots >= 0)[:, None] & (head >= num_q_heads)
    tl.store(k_cache_ptr + dest, for_cache(y1, k_cache_ptr, q_ptr), mask=kv_mask & is_k)
    tl.store(k_cache_ptr + dest + HALF, for_cache(y2, k_cache_ptr, q_ptr), mask=kv_mask & is_k)
    v_slots = tl.where(slots >= 0, slots, 0)  # -1 would give a negative block; its stores are masked anyway
    v_dest = (v_slot_offset(v_slots, v_cache_stride_block, v_cache_stride_offset, BLOCK_SIZE)[:, None]
              + kv_head * v_cache_stride_head + dims[None, :] * v_cache_stride_dim)  # fmt: skip
    tl.store(v_cache_ptr + v_dest, for_cache(y1, v_cache_ptr, q_ptr), mask=kv_mask & is_v)
    tl.store(v_cache_ptr + v_dest + HALF * v_cache_stride_dim, for_cache(y2, v_cache_ptr, q_ptr), mask=kv_mask & is_v)
