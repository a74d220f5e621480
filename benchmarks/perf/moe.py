"""Mixture-of-experts facts for the performance report: the bytes a decode step must read, and how many experts a
decode batch really touches.

A dense model's decode step reads every weight once, so the weight bytes bound it. A MoE step reads the attention
and other dense weights, the LM head, the KV cache, and only the experts its tokens were routed to: one token reads
top-k experts per layer, a batch reads the union of its tokens' choices. That union is counted here by the model's
own routers on a real decode step of the batch's size (random token ids, eager so a hook sees each layer's input),
not estimated from a uniform-routing formula. The embedding table is left out of every bound: a step reads one row
of it per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tidal.kernels.fused_moe import topk_route
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.layers.embedding import LMHead, VocabEmbedding
from tidal.worker.layers.moe import SparseMoE


def moe_layers(model: torch.nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def expert_stack_ids(model: torch.nn.Module) -> set[int]:
    """ids of the tensors with one entry per expert (the weight stacks, and their scales with FP8 experts): a step
    reads only the entries of the experts it touches, so none of them counts as a dense weight."""
    return {id(t) for layer in moe_layers(model) for t in layer.stacks()}


def one_expert_bytes(layer: SparseMoE) -> int:
    """The bytes of one expert of `layer`: its entries of every stack (gate, up and down, and their scales)."""
    return sum(t[0].numel() * t.element_size() for t in layer.stacks())


@dataclass(frozen=True)
class StepBytes:
    """What a decode step reads, apart from the experts and the KV cache."""

    dense_bytes: int  # every weight but the experts' stacks and the embedding table (the LM head included)
    expert_bytes: int  # one expert of one layer (gate, up and down, with their scales when FP8)
    experts_per_layer: int
    top_k: int
    layers: int

    @property
    def batch1_bytes(self) -> int:
        return self.dense_bytes + self.layers * self.top_k * self.expert_bytes


def gathered_tables(model: torch.nn.Module) -> set[int]:
    """ids of the embedding tables a step only gathers rows of; a tied LM head is the table itself: then it is read
    whole, so it is not among them."""
    heads = {id(m.weight) for m in model.modules() if isinstance(m, LMHead)}
    return {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding) and id(m.weight) not in heads}


def step_bytes(model: torch.nn.Module) -> StepBytes | None:
    """None for a model without experts."""
    layers = moe_layers(model)
    if not layers:
        return None
    first = layers[0]
    expert_bytes = one_expert_bytes(first)
    skipped = expert_stack_ids(model) | gathered_tables(model)
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skipped)
    return StepBytes(dense, expert_bytes, first.moe.num_experts, first.moe.top_k, len(layers))


@torch.inference_mode()
def touched_experts(engine: LLMEngine, input_ids: list[int], context_len: int) -> list[int] | None:
    """Distinct experts each MoE layer routes the tokens of one decode step to (`input_ids`: one token per
    sequence, every sequence `context_len` long), from an eager forward with a hook on every MoE layer. None when
    the cache is busy or too small for the step."""
    from perf.engine_side import decode_plan  # the plan of forward_ms, so both time and count the same step

    runner, block_size = engine.runner, engine.config.block_size
    batch = len(input_ids)
    if engine.has_unfinished_requests() or batch * -(-context_len // block_size) > runner.num_kv_blocks:
        return None
    counts: list[int] = []

    def count(module: SparseMoE, args: tuple[torch.Tensor, ...]) -> None:
        router_logits = F.linear(args[0], module.router)
        _, ids = topk_route(router_logits, module.moe.top_k, module.moe.renormalize)
        counts.append(int(ids.unique().numel()))

    layers = moe_layers(runner.model)
    handles = [layer.register_forward_pre_hook(count) for layer in layers]
    graphs, runner.decode_graphs = runner.decode_graphs, None  # a replayed graph runs no Python hook
    # The decoder's fused small-batch path calls SparseMoE.forward_small_batch, which the hook does not see: this
    # eager step runs the unfused layers (the same routing, up to the rounding of the normed input).
    fused = [layer.fuses_into_layer for layer in layers]
    for layer in layers:
        layer.fuses_into_layer = False
    try:
        runner.execute(decode_plan(batch, context_len, block_size, input_ids))
    finally:
        runner.decode_graphs = graphs
        for handle, layer, fuses in zip(handles, layers, fused, strict=True):
            handle.remove()
            layer.fuses_into_layer = fuses
    if len(counts) != len(handles):
        raise RuntimeError(f"counted {len(counts)} of {len(handles)} MoE layers: a layer ran without its hook")
    return counts


def batch_bound(facts: StepBytes, touched: list[int], kv_bytes_per_token: int, batch: int, context_len: int) -> dict:
    """The bytes a decode step of `batch` sequences of `context_len` tokens must read: the dense weights, the
    experts each layer touched (`touched`, per layer), and every sequence's KV cache."""
    experts = sum(touched) * facts.expert_bytes
    kv = batch * context_len * kv_bytes_per_token
    return {
        "batch": batch,
        "context_len": context_len,
        "touched_experts_per_layer_mean": sum(touched) / len(touched),
        "touched_experts_per_layer_min": min(touched),
        "touched_experts_per_layer_max": max(touched),
        "touched_experts_total": sum(touched),
        "expert_bytes": experts,
        "kv_bytes": kv,
        "bound_bytes": facts.dense_bytes + experts + kv,
    }


def with_times(bound: dict[str, Any], copy_tbs: float, ms_per_step: float | None, forward_ms: float | None) -> dict:
    """`bound` with its time at `copy_tbs` and the measured step and forward over it (1.0 = at the bound)."""
    bound_ms = bound["bound_bytes"] / (copy_tbs * 1e12) * 1000.0
    return {
        **bound,
        "copy_tbs": copy_tbs,
        "bound_ms": bound_ms,
        "ms_per_step": ms_per_step,
        "step_over_bound": ms_per_step / bound_ms if ms_per_step else None,
        "forward_ms": forward_ms,
        "forward_over_bound": forward_ms / bound_ms if forward_ms else None,
    }
