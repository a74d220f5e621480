"""The hardware bound of one forward step (pure, no torch): the bytes it must move over HBM bandwidth against the
FLOPs its matmuls and attention need over the dense bf16 peak (the FP8 peak for projections held in FP8, which
run as FP8 GEMMs), the larger of the two.

Bytes: every weight the step multiplies by (the embedding table left out: a step gathers one row per token), for
a MoE model only the experts its tokens touched, the KV cache its attention reads and the KV of its new tokens.
FLOPs: 2 per weight per token through the projections (the LM head only on the rows that sample, top-k experts per
token), and 4 per (query, key) pair per head dimension for attention (QK^T, then PV). Norms, rotary, activations
and sampling are left out of both: small beside these at any batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs from a model: counted from its parameters (step_counts.py), or by hand in tests."""

    dense_bytes: int  # every weight a step reads but the experts' stacks and the embedding table (LM head included)
    dense_matmul_params: int  # of those, the projections' weights, the LM head included
    lm_head_params: int  # the LM head's (applied only to the rows that sample)
    layers: int
    heads: int  # query heads
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token over every layer, in the cache's dtype
    expert_bytes: int = 0  # one expert of one layer (gate, up and down); 0 for a dense model
    expert_params: int = 0
    top_k: int = 0  # experts each token multiplies through, per layer
    fp8_matmul_params: int = 0  # of the projections (the LM head never), those held in FP8
    fp8_experts: bool = False  # the experts' stacks held in FP8


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes  # K and V


@dataclass(frozen=True)
class StepBound:
    weight_bytes: int  # dense weights and the experts touched
    kv_bytes: int  # the cache read by attention and the new tokens' K/V written
    flops: float  # all of them, fp8_flops included
    copy_tbs: float
    peak_tflops: float  # dense 16-bit
    touched_experts: int  # summed over the layers; 0 for a dense model
    fp8_flops: float = 0.0  # through weights held in FP8, at fp8_peak_tflops
    fp8_peak_tflops: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def memory_us(self) -> float:
        return self.total_bytes / (self.copy_tbs * 1e12) * 1e6

    @property
    def compute_us(self) -> float:
        fp8 = self.fp8_flops / (self.fp8_peak_tflops * 1e12) if self.fp8_flops else 0.0
        return ((self.flops - self.fp8_flops) / (self.peak_tflops * 1e12) + fp8) * 1e6

    @property
    def bound_us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def binds(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


def attention_pairs(new_tokens: list[int], seq_lens: list[int]) -> int:
    """(query, key) pairs a causal attention scores: a sequence of `seq_len` tokens whose last `new` are queries
    gives new * seq_len - new * (new - 1) / 2 (a decode token sees all `seq_len`)."""
    return sum(n * s - n * (n - 1) // 2 for n, s in zip(new_tokens, seq_lens, strict=True))


def step_bound(
    shape: ModelShape,
    new_tokens: list[int],
    seq_lens: list[int],
    sampled_rows: int,
    touched_experts: int,
    copy_tbs: float,
    peak_tflops: float,
    fp8_peak_tflops: float | None = None,
) -> StepBound:
    """A step over sequences each with `new_tokens[i]` new tokens and `seq_lens[i]` tokens after the step (the new
    ones included); `touched_experts`: distinct experts the step routes to, summed over the layers.
    `fp8_peak_tflops`: needed when the shape holds projections in FP8."""
    tokens = sum(new_tokens)
    kv = (sum(seq_lens) + tokens) * shape.kv_bytes_per_token  # attention reads every sequence's cache; new K/V written
    weights = shape.dense_bytes + touched_experts * shape.expert_bytes
    body_params = shape.dense_matmul_params - shape.lm_head_params + shape.layers * shape.top_k * shape.expert_params
    projections = 2.0 * (body_params * tokens + shape.lm_head_params * sampled_rows)
    attention = 4.0 * attention_pairs(new_tokens, seq_lens) * shape.heads * shape.head_dim * shape.layers
    fp8_params = shape.fp8_matmul_params + (
        shape.layers * shape.top_k * shape.expert_params if shape.fp8_experts else 0
    )
    if fp8_params and fp8_peak_tflops is None:
        raise ValueError("the shape holds projections in FP8: its bound needs fp8_peak_tflops")
    fp8_flops = 2.0 * fp8_params * tokens
    return StepBound(
        weights, kv, projections + attention, copy_tbs, peak_tflops, touched_experts, fp8_flops, fp8_peak_tflops or 0.0
    )


def decode_bound(
    shape: ModelShape,
    batch: int,
    context_len: int,
    touched_experts: int,
    copy_tbs: float,
    peak_tflops: float,
    fp8_peak_tflops: float | None = None,
) -> StepBound:
    """A decode step of `batch` sequences of `context_len` tokens each (the new one included), every row sampling."""
    return step_bound(
        shape, [1] * batch, [context_len] * batch, batch, touched_experts, copy_tbs, peak_tflops, fp8_peak_tflops
    )


def bound_line(bound: StepBound, wall_us: float | None) -> str:
    fp8 = f" ({bound.fp8_flops / 1e12:.2f} in FP8 at {bound.fp8_peak_tflops:g})" if bound.fp8_flops else ""
    line = (
        f"bound: weights {bound.weight_bytes / 1e9:.2f} GB + KV {bound.kv_bytes / 1e9:.2f} GB = "
        f"{bound.total_bytes / 1e9:.2f} GB -> {bound.memory_us:.0f} us at {bound.copy_tbs:g} TB/s; "
        f"{bound.flops / 1e12:.2f} TFLOP -> {bound.compute_us:.0f} us at {bound.peak_tflops:g} TFLOP/s{fp8}; "
        f"bound max = {bound.bound_us:.0f} us ({bound.binds})"
    )
    if bound.touched_experts:
        line += f"; experts touched {bound.touched_experts} in all"
    if wall_us is not None:
        line += f"; wall / bound = {wall_us / bound.bound_us:.2f} x"
    return line
