# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""SiLU-and-multiply (gated MLP activation): the torch reference, the Triton kernel and the dispatching entry point."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim


def _check_inputs(x: torch.Tensor) -> None:
    check_ndim("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate then up halves), got {x.shape[1]}")
    check_last_dim_contiguous("x", x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> [T, I] = silu(x[:, :I]) * x[:, I:], computed in fp32 and stored in x's dtype."""
    _check_inputs(x)
    half = x.shape[1] // 2
    xf = x.float()
    return (F.silu(xf[:, :half]) * xf[:, half:]).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """The Triton kernel; same contract as `silu_and_mul_reference`."""
    _check_inputs(x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(block, triton.next_power_of_2(inter))
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
