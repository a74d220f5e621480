# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel of a one-row projection as a row-parallel GEMV (wrapper: small_batch_linear, `OneRowConfig`).

At one row `linear_rows_kernel` pads the row to a 16-row tensor-core tile and gives each program 32-64 outputs over
a share of K, so a 2048-output projection is ~128 programs and a split-K reduction. Here each program owns BLOCK_N
whole weight rows, streams them in contiguous runs of BLOCK_K inputs, and reduces with sums (no tensor cores, no
split, no partials): thousands of small programs, which keeps far more loads in flight per multiprocessor
(benchmarks/kernels/probe_row_gemv.py). The epilogue is linear_rows_kernel's, on one row."""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel


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
    USE_PDL: tl.constexpr,
):
    """Program p: outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of the row (and their up rows when GATED), then the
    epilogue: FP8 scales, 1 / rms, bias, silu(gate) * up, or the residual sum with h * gamma and this program's sum
    of h^2 (one partial per program, in program order for the next norm)."""
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outs < n_out
    W_FP8: tl.constexpr = w_ptr.dtype.element_ty == tl.float8e4nv
    # The epilogue's small inputs first, each round trip overlapping the weight stream (as in linear_rows_kernel).
    if ROW_SCALE:
        sum_sq = tl.zeros([BLOCK_P], tl.float32)
        for p0 in range(0, num_partials_in, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            sum_sq += tl.load(norm_partials_ptr + ps, mask=ps < num_partials_in, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / k_in + eps)
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
    acc = _row_products(a_ptr, w_ptr, w_stride, k_in, outs, out_mask, BLOCK_N, BLOCK_K)
    if GATED:
        acc_up = _row_products(a_ptr, w_ptr + n_out.to(tl.int64) * w_stride, w_stride, k_in, outs, out_mask, BLOCK_N,
                               BLOCK_K)  # fmt: skip
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
