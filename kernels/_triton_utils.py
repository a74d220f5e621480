# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
"""Small @triton.jit helpers shared by the attention and MoE kernels."""

import triton
import triton.language as tl


@triton.jit
def exact_dot(a, b, IS_FP32: tl.constexpr, acc=None):
    """tl.dot accumulating in fp32 (into `acc` when given, in place on the tensor cores); fp32 operands use
    full-precision products instead of tf32, so fp32 runs can be checked tightly against the reference."""
    if IS_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
