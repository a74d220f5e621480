# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of one-row projections as row-parallel GEMVs (wrappers: small_batch_linear and small_batch_qkv,
`OneRowConfig`).

At one row `linear_rows_kernel` pads the row to a 16-row tensor-core tile and gives each program 32-64 outputs over
a share of K, so a 2048-output projection is ~128 programs and a split-K reduction. Here each program owns BLOCK_N
whole weight rows, streams them in contiguous runs of BLOCK_K inputs, and reduces with sums (no tensor cores, no
split, no partials): thousands of small programs, which keeps far more loads in flight per multiprocessor
(benchmarks/kernels/probe_row_gemv.py). The epilogues are linear_rows_kernel's and qkv_rope_kernel's, on one row."""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import (
    arrives_last,
    for_cache,
    let_next_kernel_launch,
    v_slot_offset,
    wait_for_previous_kernel,
)


@triton.jit
def _row_products(a_ptr, w_ptr, w_stride, k_in, outs, out_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32 W[outs] @ a over all of K: products widened to fp32 (an e4m3 weight is unscaled here), summed
    per lane along K and across lanes once at the end."""
    rows = w_ptr + outs.to(tl.int64)[:, None] * w_stride
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        # Each weight byte is read once by the whole step: evict first, the activations and epilogue inputs stay.
        w = tl.load(rows + ks[None, :], mask=out_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        a = tl.load(a_ptr + ks, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _whole_rows(w_ptr, w_stride, k_in, outs, out_mask, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] the rows `outs` of W whole (BLOCK_K >= K), loaded as one tile: a weights-first program
    issues this before its wait, so its weight stream runs while the previous kernel still does."""
    ks = tl.arange(0, BLOCK_K)
    rows = w_ptr + outs.to(tl.int64)[:, None] * w_stride
    return tl.load(rows + ks[None, :], mask=out_mask[:, None] & (ks < k_in)[None, :], other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _whole_row_products(w, a_ptr, k_in, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32 w @ a for rows loaded whole by _whole_rows."""
    ks = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + ks, mask=ks < k_in, other=0.0)
    return tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)


@triton.jit
def _inv_rms(partials_ptr, num_partials, k_in, eps, BLOCK_P: tl.constexpr):
    """1 / rms of the row from the previous kernel's partial sums of squares [num_partials, 1], BLOCK_P a load."""
    sum_sq = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_partials, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        sum_sq += tl.load(partials_ptr + ps, mask=ps < num_partials, other=0.0)
    return tl.rsqrt(tl.sum(sum_sq, axis=0) / k_in + eps)


@triton.jit
def one_row_linear_kernel(
    a_ptr,  # [1, K]
    w_ptr,  # [N, K]; gated: gate rows [0, N_OUT), up rows [N_OUT, 2 N_OUT); 16-bit, fp32 or e4m3
    w_scale_ptr,  # [N] fp32 scales of an e4m3 W's rows (output channels)
    bias_ptr,  # [N] when HAS_BIAS
    norm_partials_ptr,  # [P_IN, 1] fp32 when ROW_SCALE
    residual_ptr,  # [1, N_OUT] when INTO_RESIDUAL
    gamma_ptr,  # [N_OUT] when INTO_RESIDUAL
    y_ptr,  # [1, N_OUT]: the output, or the new residual when INTO_RESIDUAL
    scaled_ptr,  # [1, N_OUT] h * gamma when INTO_RESIDUAL
    partial_sq_ptr,  # [num programs, 1] fp32 when INTO_RESIDUAL
    n_out,
    k_in,
    w_stride,
    num_partials_in,
    eps,
    ROW_SCALE: tl.constexpr,
    GATED: tl.constexpr,
    INTO_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of the row (and their up rows when GATED), then the
    epilogue: FP8 scales, 1 / rms, bias, silu(gate) * up, or the residual sum with h * gamma and this program's sum
    of h^2 (one partial per program, in program order for the next norm). WEIGHTS_FIRST (BLOCK_K >= K): the rows
    are loaded whole before the wait for the previous kernel; weights are no kernel's output."""
    pid = tl.program_id(0)
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outs < n_out
    if WEIGHTS_FIRST:
        w_rows = _whole_rows(w_ptr, w_stride, k_in, outs, out_mask, BLOCK_K)
        if GATED:
            w_rows_up = _whole_rows(w_ptr + n_out.to(tl.int64) * w_stride, w_stride, k_in, outs, out_mask, BLOCK_K)
    wait_for_previous_kernel(USE_PDL)
    W_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    # The epilogue's small inputs first, each round trip overlapping the weight stream (as in linear_rows_kernel).
    if ROW_SCALE:
        inv_rms = _inv_rms(norm_partials_ptr, num_partials_in, k_in, eps, BLOCK_P)
    if W_FP8:
        w_scale = tl.load(w_scale_ptr + outs, mask=out_mask, other=1.0)
        if GATED:
            w_scale_up = tl.load(w_scale_ptr + n_out + outs, mask=out_mask, other=1.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + n_out + outs, mask=out_mask, other=0.0).to(tl.float32)
    if INTO_RESIDUAL:
        res = tl.load(residual_ptr + outs, mask=out_mask, other=0.0)
        gamma = tl.load(gamma_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)
    if WEIGHTS_FIRST:
        acc = _whole_row_products(w_rows, a_ptr, k_in, BLOCK_K)
        if GATED:
            acc_up = _whole_row_products(w_rows_up, a_ptr, k_in, BLOCK_K)
    else:
        acc = _row_products(a_ptr, w_ptr, w_stride, k_in, outs, out_mask, BLOCK_N, BLOCK_K)
        if GATED:
            acc_up = _row_products(a_ptr, w_ptr + n_out.to(tl.int64) * w_stride, w_stride, k_in, outs, out_mask,
                                   BLOCK_N, BLOCK_K)  # fmt: skip
    let_next_kernel_launch(USE_PDL)  # its programs can settle in while this one runs its epilogue
    if W_FP8:
        acc = acc * w_scale
        if GATED:
            acc_up = acc_up * w_scale_up
    if ROW_SCALE:
        acc = acc * inv_rms
        if GATED:
            acc_up = acc_up * inv_rms
    if HAS_BIAS:
        acc += bias
        if GATED:
            acc_up += bias_up
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if INTO_RESIDUAL:
        # Rounded twice, as the unfused layer rounds: the projection's output, then the residual sum.
        h = (acc.to(y_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + outs, h, mask=out_mask)
        hf = h.to(tl.float32)
        tl.store(scaled_ptr + outs, (hf * gamma).to(scaled_ptr.dtype.element_ty), mask=out_mask)
        tl.store(partial_sq_ptr + pid, tl.sum(tl.where(out_mask, hf * hf, 0.0), axis=0))
    else:
        tl.store(y_ptr + outs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _finish_pair(x1, x2, head, dims, dim_ok, position, slot, is_q, is_k, is_v, cos_sin_ptr, cos_sin_stride, q_ptr,
                 k_cache_ptr, v_cache_ptr, q_gamma_ptr, k_gamma_ptr, q_eps, k_eps, num_q_heads, num_kv_heads,
                 v_stride_block, v_stride_offset, v_stride_head, v_stride_dim, HEAD_DIM: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr):  # fmt: skip
    """Dims `dims` of both halves of one head (x1, x2 fp32, already rounded to the activations' dtype): q and k
    normalised (QK_NORM; then `dims` is the whole half) and rotated, q stored, k and v written to the caches."""
    if QK_NORM:
        sum_sq = tl.sum(tl.where(dim_ok, x1 * x1 + x2 * x2, 0.0), axis=0)
        inv_rms = tl.rsqrt(sum_sq / HEAD_DIM + tl.where(is_q, q_eps, k_eps))
        g1 = tl.where(is_q, tl.load(q_gamma_ptr + dims, mask=dim_ok, other=0.0),
                      tl.load(k_gamma_ptr + dims, mask=dim_ok, other=0.0)).to(tl.float32)  # fmt: skip
        g2 = tl.where(is_q, tl.load(q_gamma_ptr + HALF + dims, mask=dim_ok, other=0.0),
                      tl.load(k_gamma_ptr + HALF + dims, mask=dim_ok, other=0.0)).to(tl.float32)  # fmt: skip
        # Rounded again, as the separate norm's output is before its rotation; v is not normalised.
        x1 = tl.where(is_v, x1, (x1 * inv_rms * g1).to(q_ptr.dtype.element_ty).to(tl.float32))
        x2 = tl.where(is_v, x2, (x2 * inv_rms * g2).to(q_ptr.dtype.element_ty).to(tl.float32))
    angles = cos_sin_ptr + position * cos_sin_stride + dims
    cos = tl.load(angles, mask=dim_ok, other=1.0).to(tl.float32)
    sin = tl.load(angles + HALF, mask=dim_ok, other=0.0).to(tl.float32)
    y1 = tl.where(is_v, x1, x1 * cos - x2 * sin)
    y2 = tl.where(is_v, x2, x2 * cos + x1 * sin)
    q_out = q_ptr + head * HEAD_DIM + dims
    tl.store(q_out, y1.to(q_ptr.dtype.element_ty), mask=dim_ok & is_q)
    tl.store(q_out + HALF, y2.to(q_ptr.dtype.element_ty), mask=dim_ok & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    kv_mask = dim_ok & (slot >= 0) & (head >= num_q_heads)
    dest = slot * (num_kv_heads * HEAD_DIM) + kv_head * HEAD_DIM + dims
    tl.store(k_cache_ptr + dest, for_cache(y1, k_cache_ptr, q_ptr), mask=kv_mask & is_k)
    tl.store(k_cache_ptr + dest + HALF, for_cache(y2, k_cache_ptr, q_ptr), mask=kv_mask & is_k)
    v_slot = tl.where(slot >= 0, slot, 0)  # -1 would give a negative block; its stores are masked anyway
    v_dest = (v_slot_offset(v_slot, v_stride_block, v_stride_offset, BLOCK_SIZE) + kv_head * v_stride_head
              + dims * v_stride_dim)  # fmt: skip
    tl.store(v_cache_ptr + v_dest, for_cache(y1, v_cache_ptr, q_ptr), mask=kv_mask & is_v)
    tl.store(v_cache_ptr + v_dest + HALF * v_stride_dim, for_cache(y2, v_cache_ptr, q_ptr), mask=kv_mask & is_v)


@triton.jit
def one_row_qkv_kernel(
    a_ptr,  # [1, K]
    w_ptr,  # [(Hq + 2 Hkv) * D, K]: q heads, then k heads, then v heads; 16-bit, fp32 or e4m3
    w_scale_ptr,  # [(Hq + 2 Hkv) * D] fp32 scales of an e4m3 W's rows
    bias_ptr,  # [(Hq + 2 Hkv) * D] when HAS_BIAS
    norm_partials_ptr,  # [P_IN, 1] fp32 when ROW_SCALE
    positions_ptr,  # [1]
    cos_sin_ptr,  # [max_position, D]: cos of the D/2 frequencies, then their sin
    slot_ptr,  # [1] cache slot of the row's k and v; -1: not written
    q_ptr,  # [1, Hq * D] rotated q out
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] (dense slots)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] at its strides (kernels/kv_layout.py)
    q_gamma_ptr,  # [D] q's per-head norm weight when QK_NORM
    k_gamma_ptr,  # [D] k's, when QK_NORM
    workspace_ptr,  # [heads, D] fp32: each head's projected values, when QK_NORM over several programs a head
    counters_ptr,  # [>= heads] int32 arrival counters, zero between launches, likewise
    k_in,
    w_stride,
    num_partials_in,
    eps,
    q_eps,
    k_eps,
    cos_sin_stride,
    num_q_heads,
    num_kv_heads,
    v_stride_block,
    v_stride_offset,
    v_stride_head,
    v_stride_dim,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PROGRAMS_PER_HEAD: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: BLOCK_N dims of both halves of head p // PROGRAMS_PER_HEAD (rotary pairs), their weight rows
    streamed whole as in one_row_linear_kernel (WEIGHTS_FIRST: loaded before the wait, as there); then the fused
    qkv's epilogue (qkv_rope_kernel's, on one row). A q/k norm needs the head's every value: with several programs
    a head, each stores its values to the workspace and counts in on the head's counter, and the last one finishes
    the whole head."""
    pid = tl.program_id(0)
    head = pid // PROGRAMS_PER_HEAD
    dims = (pid % PROGRAMS_PER_HEAD) * BLOCK_N + tl.arange(0, BLOCK_N)  # within the half
    dim_ok = dims < HALF
    outs = head * HEAD_DIM + dims
    if WEIGHTS_FIRST:
        w_rows1 = _whole_rows(w_ptr, w_stride, k_in, outs, dim_ok, BLOCK_K)
        w_rows2 = _whole_rows(w_ptr, w_stride, k_in, outs + HALF, dim_ok, BLOCK_K)
    wait_for_previous_kernel(USE_PDL)
    W_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    if ROW_SCALE:
        inv_rms = _inv_rms(norm_partials_ptr, num_partials_in, k_in, eps, BLOCK_P)
    if W_FP8:
        w_scale1 = tl.load(w_scale_ptr + outs, mask=dim_ok, other=1.0)
        w_scale2 = tl.load(w_scale_ptr + outs + HALF, mask=dim_ok, other=1.0)
    if HAS_BIAS:
        bias1 = tl.load(bias_ptr + outs, mask=dim_ok, other=0.0).to(tl.float32)
        bias2 = tl.load(bias_ptr + outs + HALF, mask=dim_ok, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    if WEIGHTS_FIRST:
        x1 = _whole_row_products(w_rows1, a_ptr, k_in, BLOCK_K)
        x2 = _whole_row_products(w_rows2, a_ptr, k_in, BLOCK_K)
    else:
        x1 = _row_products(a_ptr, w_ptr, w_stride, k_in, outs, dim_ok, BLOCK_N, BLOCK_K)
        x2 = _row_products(a_ptr, w_ptr, w_stride, k_in, outs + HALF, dim_ok, BLOCK_N, BLOCK_K)
    let_next_kernel_launch(USE_PDL)
    if W_FP8:
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
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads)
    if QK_NORM and PROGRAMS_PER_HEAD > 1:
        row = workspace_ptr + head.to(tl.int64) * HEAD_DIM
        tl.store(row + dims, x1, mask=dim_ok)
        tl.store(row + HALF + dims, x2, mask=dim_ok)
        counter = counters_ptr + head
        last = arrives_last(counter, PROGRAMS_PER_HEAD)
        half_dims = tl.arange(0, HALF)
        # .cg: from L2, where the head's other programs stored theirs, never a stale L1 line.
        x1 = tl.load(row + half_dims, mask=last, other=0.0, cache_modifier=".cg")
        x2 = tl.load(row + HALF + half_dims, mask=last, other=0.0, cache_modifier=".cg")
        _finish_pair(x1, x2, head, half_dims, last & (half_dims < HALF), position, slot, is_q, is_k, is_v,
                     cos_sin_ptr, cos_sin_stride, q_ptr, k_cache_ptr, v_cache_ptr, q_gamma_ptr, k_gamma_ptr, q_eps,
                     k_eps, num_q_heads, num_kv_heads, v_stride_block, v_stride_offset, v_stride_head, v_stride_dim,
                     HEAD_DIM, HALF, BLOCK_SIZE, QK_NORM)  # fmt: skip
        tl.store(counter, 0, mask=last)  # ready for the next launch
    else:
        _finish_pair(x1, x2, head, dims, dim_ok, position, slot, is_q, is_k, is_v, cos_sin_ptr, cos_sin_stride,
                     q_ptr, k_cache_ptr, v_cache_ptr, q_gamma_ptr, k_gamma_ptr, q_eps, k_eps, num_q_heads,
                     num_kv_heads, v_stride_block, v_stride_offset, v_stride_head, v_stride_dim, HEAD_DIM, HALF,
                     BLOCK_SIZE, QK_NORM)  # fmt: skip
