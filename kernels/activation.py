# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""SiLU-and-multiply (gated MLP activation): the torch reference, the Triton kernel and the dispatching entry point.
With `quantize` the rows come out quantized to e4m3 with a scale each, for an FP8 down projection
(tidal.kernels.fp8_linear.QuantizedRows): one program then holds a whole row."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tidal.kernels._fp8_linear_kernels import store_quantized_row
from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim
from tidal.kernels.fp8_linear import MIN_SCALE, QuantizedRows, quantized_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3


def _check_inputs(x: torch.Tensor) -> None:
    check_ndim("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate then up halves), got {x.shape[1]}")
    check_last_dim_contiguous("x", x)


# A quantizing program holds a whole row of the result in registers.
MAX_QUANTIZED_INTER = 65536


def silu_and_mul_reference(x: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """x [T, 2*I] -> [T, I] = silu(x[:, :I]) * x[:, I:], computed in fp32 and stored in x's dtype (`quantize`: then
    as QuantizedRows)."""
    _check_inputs(x)
    half = x.shape[1] // 2
    xf = x.float()
    out = (F.silu(xf[:, :half]) * xf[:, half:]).to(x.dtype)
    return quantized_rows_reference(out) if quantize else out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_quantized_kernel(x_ptr, q_ptr, scale_ptr, inter, x_stride, min_scale, BLOCK: tl.constexpr):
    """Program t: row t's whole result, rounded to x's dtype, then quantized (store_quantized_row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    store_quantized_row(out, q_ptr + row * inter, scale_ptr, row, cols, mask, min_scale)


def silu_and_mul_triton(x: torch.Tensor, block: int = 4096, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """The Triton kernel; same contract as `silu_and_mul_reference`."""
    _check_inputs(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if quantize:
        if inter > MAX_QUANTIZED_INTER:
            raise ValueError(f"a quantized row of {inter} exceeds the kernel's limit {MAX_QUANTIZED_INTER}")
        q = torch.empty((num_tokens, inter), dtype=FP8_E4M3, device=x.device)
        scale = torch.empty((num_tokens,), dtype=torch.float32, device=x.device)
        if q.numel() > 0:
            row_block = triton.next_power_of_2(inter)
            warps = min(max(row_block // 512, 1), 16)
            _silu_and_mul_quantized_kernel[(num_tokens,)](
                x, q, scale, inter, x.stride(0), MIN_SCALE, BLOCK=row_block, num_warps=warps
            )
        return QuantizedRows(q, scale, x.dtype)
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(block, triton.next_power_of_2(inter))
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out


def silu_and_mul(x: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """Triton on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return silu_and_mul_triton(x, quantize=quantize)
    return silu_and_mul_reference(x, quantize)
