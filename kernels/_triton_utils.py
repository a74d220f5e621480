# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Small @triton.jit helpers shared by the attention and MoE kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def exact_dot(a, b, IS_FP32: tl.constexpr, acc=None):
    """tl.dot accumulating in fp32 (into `acc` when given, in place on the tensor cores); fp32 operands use
    full-precision products instead of tf32, so fp32 runs can be checked tightly against the reference."""
    if IS_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """With programmatic dependent launch this kernel may start while the previous one finishes; nothing it reads
    from an earlier kernel is safe to read before this wait (weights and other inputs no kernel writes are)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(USE_PDL: tl.constexpr):
    """Allows the next kernel, if launched with PDL, to start its programs now (they wait before reading our output)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def arrives_last(counter_ptr, NUM_SPLITS: tl.constexpr):
    """Counts this program in on its output tile's arrival counter (kernels/_split_k.py) once its partial is stored;
    -> whether it is the tile's last split, the one that may now read every split's partial (loads with .cg: from
    L2, never a stale L1 line) and must set the counter back to zero for the next launch."""
    tl.debug_barrier()  # every thread's partial is written before the count releases them
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # and read by the last split's threads only after its count acquired them
    return arrived == NUM_SPLITS - 1
