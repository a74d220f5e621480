# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Small @triton.jit helpers shared by the attention and MoE kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tidal.kernels.kv_cache_dtype import FP8_E4M3_MAX

# A @triton.jit function reads a module global only if it is a tl.constexpr instance (an annotation is not enough).
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
FP16_MAX = tl.constexpr(65504.0)  # torch.finfo(torch.float16).max


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
def round_to_e4m3(x):
    """fp32 x -> the nearest FP8 e4m3 value (ties to even), clamped to +-448, still in fp32. Rounding here, in fp32
    arithmetic, makes the cast that follows exact: the compiled kernels and the interpreter (whose own fp32 -> e4m3
    cast mishandles a rounding carry: 127.5 -> 64) then store the same bits as torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below its smallest normal exponent (-6) its steps stay 2^-9 (subnormals).
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)  # 2^-step_exponent, a normal float
    scaled = x * inverse_step  # exact: a power of two (a division would compile to an approximate one); |scaled| < 16
    rounded = (scaled + 12582912.0) - 12582912.0  # adding 1.5 * 2^23 rounds to an integer, ties to even
    # NaN stays NaN, as in torch
    value = tl.clamp(rounded * step, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    signed_zero = tl.where(bits < 0, -1.0, 1.0) * 0.0  # a negative value (or -0) rounding to zero keeps its sign
    return tl.where(value == 0.0, signed_zero, value)


@triton.jit
def for_cache(x, cache_ptr, act_ptr):
    """fp32 x as the KV cache at `cache_ptr` stores it: in the activations' dtype (that of `act_ptr`), or for an
    FP8 cache that value rounded to e4m3 (kernels/kv_cache_dtype.py)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return round_to_e4m3(x.to(act_ptr.dtype.element_ty).to(tl.float32)).to(tl.float8e4nv)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def v_slot_offset(slot, stride_block, stride_offset, BLOCK_SIZE: tl.constexpr):
    """Elements from the V cache's start to a slot's (head 0, dim 0), in whichever layout V has
    (kernels/kv_layout.py); `slot` is int64."""
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset


@triton.jit
def q_for_cache(q, cache_ptr, IS_FP32: tl.constexpr):
    """q in the type of its products with the cached keys and values: its own, or beside an FP8 cache fp16
    (clamped to fp16's range), the type e4m3 converts to in one packed instruction. Converting the tiles to bf16
    takes a second, unpacked conversion per element through fp16, which made decode attention slower than from a
    bf16 cache (benchmarks/results/kv-cache-fp8-h200.md). fp16 holds every e4m3 value exactly and the probabilities
    P more finely than bf16; sums stay fp32."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and not IS_FP32:
        return tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    else:
        return q


@triton.jit
def arrives_last(counter_ptr, NUM_SPLITS: tl.constexpr):
    """Counts this program in on its output tile's arrival counter (kernels/_split_k.py) once its partial is stored;
    -> whether it is the tile's last split, the one that may now read every split's partial (loads with .cg: from
    L2, never a stale L1 line) and must set the counter back to zero for the next launch."""
    tl.debug_barrier()  # every thread's partial is written before the count releases them
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # and read by the last split's threads only after its count acquired them
    return arrived == NUM_SPLITS - 1
