"""The KV cache's element type: the activations' own (16-bit or fp32), or FP8 e4m3 at half the bytes of bf16.

An FP8 cache holds K and V as they are, with no scale: e4m3 keeps 3 mantissa bits and saturates at +-448, which
post-RoPE keys and values of trained models stay well inside (a per-tensor scale of 1.0, what vLLM uses for an FP8
cache without calibrated scales). A value is first rounded to the activations' dtype, as a 16-bit cache would hold it,
then to the nearest e4m3 value (ties to even), clamped to +-448, NaN kept; the kernels' rounding
(`_triton_utils.for_cache`) gives the same bits as the references' (`to_cache_dtype`) for the same input. Attention
converts the cached values back on load, to fp16 beside 16-bit activations (`_triton_utils.q_for_cache`: q and the
probabilities then go to fp16 too) and to fp32 beside fp32 ones; sums stay fp32.

What it buys: twice the tokens in the same memory, and half the bytes a decode step reads for attention, which at
large batch and long context is most of the step. V is stored with each block's tokens innermost
(kernels/kv_layout.py), because the tensor cores want V's tokens in pairs and there is no 8-bit transposing
shared-memory load: with head dims innermost Triton read V byte by byte, and decode attention was no faster than
from bf16 (benchmarks/results/kv-cache-fp8-h200.md); with tokens innermost it is 11-20% faster than from bf16
(kv-cache-fp8-v-layout-h200.md).
"""

import torch

from tidal.kernels._device import cuda_capability
from tidal.kernels._validate import FLOAT_DTYPES

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# The names `EngineConfig.kv_cache_dtype` accepts besides "auto" (the activations' dtype); "fp8" is e4m3, as in vLLM.
FP8_NAMES = ("fp8", "fp8_e4m3")


def kv_cache_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a configured name."""
    if name == "auto":
        return activation_dtype
    if name in FP8_NAMES:
        return FP8_E4M3
    raise ValueError(f"unknown KV cache dtype {name!r}; expected 'auto' or one of {FP8_NAMES}")


# The oldest GPUs whose Triton kernels can convert to and from e4m3 (Ada, Hopper and newer).
FP8_MIN_CAPABILITY = (8, 9)


def check_device_holds(cache_dtype: torch.dtype, device: torch.device) -> None:
    """Refuses an FP8 cache on a GPU older than FP8_MIN_CAPABILITY, before any kernel is compiled for it (Triton's
    own error would come from deep inside the first compile). CPUs take every dtype (the references)."""
    if cache_dtype == FP8_E4M3:
        require_fp8_device(device, "an FP8 KV cache needs", "kv_cache_dtype")


def require_fp8_device(device: torch.device, what_needs: str, option: str) -> None:
    """ValueError, naming the GPU and `option` (the setting to turn back to 'auto'), on a GPU older than
    FP8_MIN_CAPABILITY; CPUs and newer GPUs pass. `what_needs`: the sentence's start, e.g. "FP8 weights need"."""
    if device.type != "cuda":
        return
    capability = cuda_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        wanted = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ValueError(
            f"{what_needs} a GPU of compute capability {wanted} or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use {option} 'auto'"
        )


def check_cache_dtype(names: str, activation_dtype: torch.dtype, *caches: torch.Tensor) -> None:
    """Caches hold the activations' dtype, or FP8 e4m3 beside 16-bit or fp32 activations."""
    allowed = {activation_dtype, FP8_E4M3} if activation_dtype in FLOAT_DTYPES else {activation_dtype}
    for cache in caches:
        if cache.dtype not in allowed:
            raise ValueError(
                f"{names} must have the activations' dtype ({activation_dtype}) or {FP8_E4M3}, got {cache.dtype}"
            )
    if len({c.dtype for c in caches}) > 1:
        raise ValueError(f"{names} must share one dtype, got {[c.dtype for c in caches]}")


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x (in the activations' dtype) as the cache stores it: the same values, or for FP8 the nearest e4m3 value
    (ties to even), clamped to +-448 (torch's own cast would turn values past 448 into NaN)."""
    if cache_dtype != FP8_E4M3:
        return x.to(cache_dtype)
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)
