"""FP8 experts: what the MoE kernels take besides the stacks when those hold e4m3 weights, and the checks on it.

A layer that serves its experts in FP8 (`EngineConfig.weight_dtype` "fp8") keeps w13 [E, 2I, H] and w2 [E, H, I] in
e4m3 with one fp32 scale per output channel of each expert: `ExpertScales` (w13 [E, 2I], w2 [E, H]). The kernels
read the e4m3 weights, widen them to the activations' dtype (exact: every e4m3 value is a bf16 value), accumulate
in fp32 as for 16-bit experts, and multiply each output channel by its scale once, after the K loop, since a per
output channel scale factors out of the sum. So a decode step streams half the expert bytes; the arithmetic stays
16-bit (W8A16), which is what a memory-bound expert GEMM wants.
"""

from typing import NamedTuple

import torch

from tidal.kernels._validate import FLOAT_DTYPES, check_contiguous, check_dtype, check_same_dtype, check_shape
from tidal.kernels.kv_cache_dtype import FP8_E4M3


class ExpertScales(NamedTuple):
    """Per output channel scales of FP8 expert stacks: w13 [E, 2I] (gate rows, then up rows) and w2 [E, H], fp32."""

    w13: torch.Tensor
    w2: torch.Tensor


def check_expert_weights(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None
) -> None:
    """16-bit (or fp32) stacks in hidden's dtype without scales; e4m3 stacks with contiguous fp32 scales of the
    stacks' output shapes. ValueError naming what does not fit. (Stack shapes are checked by the callers.)"""
    if scales is None:
        check_same_dtype("hidden, w13 and w2", hidden, w13, w2)
        return
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_dtype("w13", w13, (FP8_E4M3,))
    check_dtype("w2", w2, (FP8_E4M3,))
    check_shape("scales.w13", scales.w13, tuple(w13.shape[:2]))
    check_shape("scales.w2", scales.w2, tuple(w2.shape[:2]))
    for name, scale in (("scales.w13", scales.w13), ("scales.w2", scales.w2)):
        check_dtype(name, scale, (torch.float32,))
        check_contiguous(name, scale)
    if len({hidden.device, w13.device, w2.device, scales.w13.device, scales.w2.device}) > 1:
        raise ValueError("hidden, the expert stacks and their scales must be on one device")
