# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel of the FP8 linear layers (wrapper: fp8_linear): each row of the activations quantized to e4m3 with
a scale of its own, for the FP8 GEMM that follows."""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import round_to_e4m3
from tidal.kernels.kv_cache_dtype import FP8_E4M3_MAX

_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def quantize_rows_kernel(
    x_ptr,  # [M, K] 16-bit or fp32
    q_ptr,  # [M, K] e4m3 out
    scale_ptr,  # [M] fp32 out: x ~= q * scale
    k_in,
    x_stride,
    q_stride,
    min_scale,
    BLOCK_K: tl.constexpr,
):
    """Program m: row m's largest magnitude (first pass), then the row divided by amax / 448 and rounded to e4m3
    (second pass; the row is in L2 by then). Both divisions are IEEE-rounded (div_rn), as torch's are, so the bits
    equal the reference's."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * x_stride + ks, mask=ks < k_in, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _E4M3_MAX), min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = ks < k_in
        x = tl.load(x_ptr + row * x_stride + ks, mask=mask, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.math.div_rn(x, scale))
        tl.store(q_ptr + row * q_stride + ks, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def store_quantized_row(y, q_row_ptr, scale_ptr, row, cols, mask, min_scale):
    """One row y [BLOCK] (fp32 holding values of the activations' dtype, zeros past `mask`), quantized as
    quantize_rows_kernel quantizes it, into q_row_ptr + cols and its scale into scale_ptr + row: for a kernel that
    holds whole rows (RMSNorm, SiLU-and-mul) and feeds an FP8 GEMM."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), _E4M3_MAX), min_scale)
    tl.store(scale_ptr + row, scale)
    tl.store(q_row_ptr + cols, round_to_e4m3(tl.math.div_rn(y, scale)).to(tl.float8e4nv), mask=mask)
