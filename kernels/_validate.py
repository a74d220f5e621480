"""Input checks shared by the kernel wrappers: shapes, dtypes, devices and strides, raising ValueError with the name."""

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """`None` in `shape` accepts any size in that dimension."""
    ok = tensor.dim() == len(shape) and all(
        want is None or want == got for want, got in zip(shape, tensor.shape, strict=True)
    )
    if not ok:
        wanted = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(tensor.shape)}")


def check_same_dtype(names: str, *tensors: torch.Tensor) -> None:
    if len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"{names} must share one dtype, got {[t.dtype for t in tensors]}")


def check_same_device(names: str, *tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"{names} must be on one device, got {[str(t.device) for t in tensors]}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Kernels load rows as vectors: the innermost dimension must be dense (other strides may be anything)."""
    if tensor.numel() > 0 and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {tensor.stride()}")


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")
