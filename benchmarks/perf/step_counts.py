"""The shape step_bound.py needs, counted from a built model's parameters (works on the meta device too)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from perf.moe import expert_stack_ids, gathered_tables, moe_layers, step_bytes
from perf.step_bound import ModelShape, kv_bytes_per_token
from tidal.worker.layers.embedding import LMHead
from tidal.worker.models.base import CausalLM

FP8 = torch.float8_e4m3fn  # the dtype of weights served as FP8 (worker/layers/fp8_weights.py)


def model_shape(model: CausalLM, hf_config: PretrainedConfig, kv_dtype: torch.dtype) -> ModelShape:
    """Dense weights (the embedding table and the experts' stacks aside), the projections among them (2-D weights:
    norms are read, not multiplied through) and those of them held in FP8, one expert's size (and whether the
    experts are FP8), and the attention's dimensions."""
    skipped = gathered_tables(model) | expert_stack_ids(model)
    dense = [p for p in model.parameters() if id(p) not in skipped]
    head = next(m.weight for m in model.modules() if isinstance(m, LMHead))
    spec = model.kv_cache_spec
    experts = step_bytes(model)
    expert_params, fp8_experts = 0, False
    if experts is not None:
        first = moe_layers(model)[0]
        expert_params = first.w13[0].numel() + first.w2[0].numel()
        fp8_experts = first.w13.dtype == FP8
    return ModelShape(
        dense_bytes=sum(p.numel() * p.element_size() for p in dense),
        dense_matmul_params=sum(p.numel() for p in dense if p.dim() == 2),
        lm_head_params=head.numel(),
        layers=spec.num_layers,
        heads=hf_config.num_attention_heads,
        head_dim=spec.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.empty((), dtype=kv_dtype).element_size()
        ),
        expert_bytes=experts.expert_bytes if experts else 0,
        expert_params=expert_params,
        top_k=experts.top_k if experts else 0,
        fp8_matmul_params=sum(p.numel() for p in dense if p.dim() == 2 and p.dtype == FP8),
        fp8_experts=fp8_experts,
    )
