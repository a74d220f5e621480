"""Which of a model's weights are FP8 when the engine serves them so (`EngineConfig.weight_dtype` "fp8").

Every projection of the attention blocks and the dense MLPs (`Linear`, `MergedLinear`) whose sizes are multiples of
16 holds an e4m3 weight with a scale per output channel (tidal.kernels.fp8_linear): these are what the GEMMs of a
large decode batch or a prefill spend their time in, at twice the bf16 rate on FP8 tensor cores, and half the bytes
a small-batch decode step streams. The routed experts (`SparseMoE`) hold e4m3 stacks with a scale per output channel
of each expert (tidal.kernels.moe_expert_scales): most of a MoE model's bytes, which its expert kernels stream at
every decode step, so half of them is the larger share of the saving. Kept in the activations' dtype:
- the input embedding and the LM head: a gathered table and the logits' precision (as other engines keep them);
- norms, biases and the MoE router (small, and the routing decision is not worth a rounding);
- a projection whose sizes the FP8 GEMM cannot take (Qwen2-MoE's one-output shared-expert gate).
"""

from __future__ import annotations

from torch import nn

from tidal.kernels.fp8_linear import can_quantize
from tidal.worker.layers.linear import Linear
from tidal.worker.layers.moe import SparseMoE

# `EngineConfig.weight_dtype`'s names (its WeightDType; a test keeps them equal): "auto" keeps the model dtype.
WEIGHT_DTYPES: tuple[str, ...] = ("auto", "fp8")


def hold_fp8_weights(model: nn.Module) -> int:
    """Switch every eligible projection and expert block of `model` (built on the meta device, not yet placed) to
    FP8 weights. -> how many modules. (The expert kernels widen e4m3 tiles themselves: any expert shape is eligible.)"""
    count = 0
    for module in model.modules():
        if (isinstance(module, Linear) and can_quantize(*module.weight.shape)) or isinstance(module, SparseMoE):
            module.hold_fp8()
            count += 1
    return count
