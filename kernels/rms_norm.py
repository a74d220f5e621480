# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""RMSNorm with an optional fused residual add: the torch reference, the Triton kernel and the dispatching function.
With `quantize` the normalised rows come out quantized to e4m3 with a scale each, for an FP8 projection
(tidal.kernels.fp8_linear.QuantizedRows), instead of in the activations' dtype: no quantization launch of its own."""

import torch
import triton
import triton.language as tl

from tidal.kernels._fp8_linear_kernels import store_quantized_row
from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim, check_shape
from tidal.kernels.fp8_linear import MIN_SCALE, QuantizedRows, quantized_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3

# One program normalises one row held entirely in registers; wider rows would spill.
MAX_HIDDEN = 65536


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_ndim("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[1],))
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        check_dtype("residual", residual, (x.dtype,))
        check_last_dim_contiguous("residual", residual)
    check_last_dim_contiguous("x", x)


Normed = torch.Tensor | QuantizedRows


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, quantize: bool = False
) -> Normed | tuple[Normed, torch.Tensor]:
    """x [T, H], weight [H]. Without residual: normed x. With residual: (normed(x + residual), x + residual).
    `quantize`: normed x as QuantizedRows (the rows rounded to x's dtype, then quantized)."""
    _check_inputs(x, weight, residual)
    if residual is not None:
        # The sum is rounded to x's dtype before normalising: the next layer sees exactly the stored residual.
        new_residual = (x.float() + residual.float()).to(x.dtype)  # [T, H]
        normed = _normalize(new_residual, weight, eps)
        return (quantized_rows_reference(normed) if quantize else normed), new_residual
    normed = _normalize(x, weight, eps)
    return quantized_rows_reference(normed) if quantize else normed


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # [T, H]
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # [T, 1]
    return (xf * inv_rms * weight.float()).to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    q_ptr,  # [T, H] e4m3 when QUANTIZE (out_ptr then unused)
    scale_ptr,  # [T] fp32 when QUANTIZE
    hidden,
    x_stride,
    residual_stride,
    eps,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * inv_rms * w).to(out_ptr.dtype.element_ty)
    if QUANTIZE:
        store_quantized_row(y.to(tl.float32), q_ptr + row * hidden, scale_ptr, row, cols, mask, min_scale)
    else:
        tl.store(out_ptr + row * hidden + cols, y, mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, quantize: bool = False
) -> Normed | tuple[Normed, torch.Tensor]:
    """The Triton kernel; same contract as `rms_norm_reference`. Outputs are new contiguous tensors."""
    _check_inputs(x, weight, residual)
    num_tokens, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's limit {MAX_HIDDEN}")
    weight = weight.contiguous()
    out = torch.empty((0 if quantize else num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device) if residual is not None else out
    q = torch.empty((num_tokens if quantize else 0, hidden), dtype=FP8_E4M3, device=x.device)
    scale = torch.empty((num_tokens if quantize else 0,), dtype=torch.float32, device=x.device)
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            q,
            scale,
            hidden,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            MIN_SCALE,
            HAS_RESIDUAL=residual is not None,
            QUANTIZE=quantize,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )
    normed: Normed = QuantizedRows(q, scale, x.dtype) if quantize else out
    return (normed, new_residual) if residual is not None else normed


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, quantize: bool = False
) -> Normed | tuple[Normed, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere (same contract as `rms_norm_reference`)."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual, quantize)
    return rms_norm_reference(x, weight, eps, residual, quantize)
