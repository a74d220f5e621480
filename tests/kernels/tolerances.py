"""Comparison helpers for kernel tests: tolerance by dtype, and a poison value so unwritten outputs show."""

import torch

# Triton 3.6's interpreter multiplies bf16 operands of tl.dot as raw 16-bit integers (NumPy has no bfloat16), so
# kernels built on tl.dot are checked in bf16 only on a GPU; fp16 covers the low-precision path on CPU.
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """Elementwise comparison at the dtype's tolerance times `scale`; NaN never passes."""
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=tol["atol"] * scale,
        rtol=tol["rtol"] * scale,
        equal_nan=False,
    )
