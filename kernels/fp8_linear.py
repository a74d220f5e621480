"""FP8 (e4m3) linear layers: weights with one scale per output channel, activations with one per row (token).

Why: a decode step at large batch and every prefill spend most of their time in the projections' GEMMs, which run
at the tensor cores' bf16 rate; Hopper's FP8 tensor cores run at twice it, and FP8 weights are half the bytes a
small-batch step streams (benchmarks/results/dense-batch256-h200.md).

Numbers: a weight row (output channel) w is stored as round_e4m3(w / s) with s = max|w| / 448, a row of activations
x likewise, its scale computed when the row is made (dynamic, no calibration). Then
    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]  (+ bias)
with the products exact and the sums in fp32. Both divisions are IEEE-rounded, and round_e4m3 is the nearest e4m3
value, ties to even: the Triton kernel and the reference give the same bits. A row of zeros gets the smallest scale,
MIN_SCALE, so that it quantizes to zeros instead of 0/0.

At most 16 rows (small-batch decode) the activations stay in 16 bits: the small-batch kernels read the e4m3 weight,
convert it, and multiply their sums by sw in the epilogue (tidal.kernels.small_batch_linear). Above that, the row
quantization here, then torch._scaled_mm (cuBLASLt's FP8 GEMM with a scale per row of each operand) on GPUs of
compute capability 8.9+. Elsewhere (CPU, or fp32 activations) the reference computes the same numbers in fp32.
"""

from typing import NamedTuple

import torch
import triton

from tidal.kernels._device import cuda_capability
from tidal.kernels._fp8_linear_kernels import quantize_rows_kernel
from tidal.kernels._validate import check_dtype, check_last_dim_contiguous, check_ndim, check_shape
from tidal.kernels.kv_cache_dtype import FP8_E4M3, FP8_E4M3_MAX, FP8_MIN_CAPABILITY, require_fp8_device

MIN_SCALE = 2.0**-64
# _scaled_mm needs both GEMM dimensions it reduces or emits per operand row to be multiples of 16.
FP8_GEMM_ALIGNMENT = 16
_QUANTIZE_BLOCK_K = 1024


def check_fp8_weights_fit(device: torch.device) -> None:
    """Refuses FP8 weights on a GPU older than compute capability 8.9 (no FP8 tensor cores, and Triton cannot convert
    e4m3 there), before anything is allocated. CPUs take them (the references)."""
    require_fp8_device(device, "FP8 weights need", "weight_dtype")


class QuantizedRows(NamedTuple):
    """Activations already quantized per row by the kernel that made them (RMSNorm, SiLU-and-mul with `quantize`):
    the bits `quantize_rows` would give for the rows in `dtype`, which the projection's output then takes."""

    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M] fp32
    dtype: torch.dtype  # the activations' dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantized_rows_reference(x: torch.Tensor) -> QuantizedRows:
    """x's rows quantized (the reference of the fused producers)."""
    q, scale = quantize_rows_reference(x)
    return QuantizedRows(q, scale, x.dtype)


def can_quantize(out_features: int, in_features: int) -> bool:
    """Whether a projection of this shape can hold FP8 weights: both sizes multiples of FP8_GEMM_ALIGNMENT (a 1-wide
    gate such as Qwen2-MoE's shared-expert gate stays in 16 bits)."""
    return out_features % FP8_GEMM_ALIGNMENT == 0 and in_features % FP8_GEMM_ALIGNMENT == 0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M] fp32) with x ~= q * scale[:, None]; see the module docstring."""
    check_ndim("x", x, 2)
    xf = x.float()
    # Divided by a tensor, not a Python number: on a GPU torch turns division by a number into a multiplication by
    # its reciprocal, which rounds differently; a tensor divisor keeps the IEEE quotient on every device.
    e4m3_max = xf.new_full((), FP8_E4M3_MAX)
    scale = (xf.abs().amax(dim=1) / e4m3_max if x.shape[1] else xf.new_zeros(x.shape[0])).clamp(min=MIN_SCALE)
    q = (xf / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)
    return q, scale


@torch.no_grad()
def quantize_rows_into_(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """quantize_rows_reference(x) written into `q_out` [M, K] e4m3 and `scale_out` [M] fp32 (views of live
    weights), on `x`'s device; how a checkpoint's 16-bit weight becomes an FP8 one."""
    check_dtype("q_out", q_out, (FP8_E4M3,))
    check_shape("q_out", q_out, tuple(x.shape))
    check_shape("scale_out", scale_out, (x.shape[0],))
    check_dtype("scale_out", scale_out, (torch.float32,))
    q, scale = quantize_rows_reference(x.to(q_out.device))
    q_out.copy_(q)
    scale_out.copy_(scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same contract and bits as `quantize_rows_reference`."""
    check_ndim("x", x, 2)
    check_last_dim_contiguous("x", x)
    num_rows, k_in = x.shape
    q = torch.empty((num_rows, k_in), dtype=FP8_E4M3, device=x.device)
    scale = torch.empty((num_rows,), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block_k = min(_QUANTIZE_BLOCK_K, triton.next_power_of_2(max(k_in, 16)))
    quantize_rows_kernel[(num_rows,)](x, q, scale, k_in, x.stride(0), q.stride(0), MIN_SCALE, BLOCK_K=block_k,
                                      num_warps=4)  # fmt: skip
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel for CUDA tensors, the reference otherwise."""
    return quantize_rows_triton(x) if x.is_cuda else quantize_rows_reference(x)


def _check_linear(
    x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if isinstance(x, QuantizedRows):
        check_dtype("x.q", x.q, (FP8_E4M3,))
        check_shape("x.scale", x.scale, (x.q.shape[0],))
        x = x.q
    check_ndim("x", x, 2)
    check_dtype("weight", weight, (FP8_E4M3,))
    check_ndim("weight", weight, 2)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must have {x.shape[1]} input features, got shape {tuple(weight.shape)}")
    check_shape("weight_scale", weight_scale, (weight.shape[0],))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))


def fp8_linear_reference(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight [N, K]^T (+ bias) -> [M, N] in x's dtype, the rows of x quantized first (or
    given quantized)."""
    _check_linear(x, weight, weight_scale, bias)
    rows = x if isinstance(x, QuantizedRows) else quantized_rows_reference(x)
    y = (rows.q.float() @ weight.float().T) * rows.scale[:, None] * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(rows.dtype)


def uses_fp8_gemm(x: torch.Tensor | QuantizedRows) -> bool:
    """Whether `fp8_linear` runs the FP8 GEMM for `x` (else the fp32 reference): CUDA 8.9+, 16-bit activations."""
    tensor, dtype = (x.q, x.dtype) if isinstance(x, QuantizedRows) else (x, x.dtype)
    if not tensor.is_cuda or dtype not in (torch.bfloat16, torch.float16):
        return False
    return cuda_capability(tensor.device) >= FP8_MIN_CAPABILITY


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 GEMM where `uses_fp8_gemm`, else the reference; the same numbers up to the order of the sums. `x`
    given as QuantizedRows skips the quantization launch."""
    if not uses_fp8_gemm(x):
        return fp8_linear_reference(x, weight, weight_scale, bias)
    _check_linear(x, weight, weight_scale, bias)
    if isinstance(x, QuantizedRows):
        q, scale, dtype = x
    else:
        (q, scale), dtype = quantize_rows(x.contiguous()), x.dtype
    # The second operand column-major, as cuBLASLt's FP8 kernels take it: weight [N, K] row-major is exactly that.
    y = torch._scaled_mm(q, weight.t(), scale_a=scale[:, None], scale_b=weight_scale[None, :], out_dtype=dtype)
    return y if bias is None else y + bias
