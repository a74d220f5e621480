# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""RMSNorm with an optional fused residual add: the torch reference, the Triton kernel and the dispatching function."""

import torch
import triton
import triton.language as tl

from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_ndim, check_shape

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


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H]. Without residual: normed x. With residual: (normed(x + residual), x + residual)."""
    _check_inputs(x, weight, residual)
    if residual is not None:
        # The sum is rounded to x's dtype before normalising: the next layer sees exactly the stored residual.
        new_residual = (x.float() + residual.float()).to(x.dtype)  # [T, H]
        return _normalize(new_residual, weight, eps), new_residual
    return _normalize(x, weight, eps)


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
    hidden,
    x_stride,
    residual_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
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
    tl.store(out_ptr + row * hidden + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same contract as `rms_norm_reference`. Outputs are new contiguous tensors."""
    _check_inputs(x, weight, residual)
    num_tokens, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's limit {MAX_HIDDEN}")
    weight = weight.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            hidden,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )
    return (out, new_residual) if residual is not None else out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere (same contract as `rms_norm_reference`)."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
