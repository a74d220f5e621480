"""Fused mixture-of-experts: top-k softmax routing, the torch reference expert loop, the Triton path (token sorting by
expert + grouped GEMMs, in `_moe_align` and `_moe_kernels`) and the dispatching entry point.

Weights: w13 [E, 2*I, H] (gate rows, then up rows), w2 [E, H, I]. out [T, H] = sum_k w_k * W2_e(silu(W1_e x) * W3_e x).
"""

import torch
import torch.nn.functional as F

from tidal.kernels._validate import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
)


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32): softmax then top-k."""
    check_ndim("router_logits", router_logits, 2)
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = router_logits.float().softmax(dim=-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _check_inputs(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int
) -> None:
    check_ndim("hidden", hidden, 2)
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_ndim("w13", w13, 3)
    num_experts, two_i, hidden_size = w13.shape
    if two_i % 2 != 0:
        raise ValueError(f"w13's second dimension must be even (gate rows then up rows), got {two_i}")
    if hidden_size != hidden.shape[1]:
        raise ValueError(f"w13 hidden size {hidden_size} != hidden's {hidden.shape[1]}")
    check_shape("w2", w2, (num_experts, hidden_size, two_i // 2))
    check_shape("router_logits", router_logits, (hidden.shape[0], num_experts))
    check_same_dtype("hidden, w13 and w2", hidden, w13, w2)
    check_same_device("hidden, w13, w2 and router_logits", hidden, w13, w2, router_logits)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")


def fused_moe_experts_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The expert computation for given routing: hidden [T, H], topk_weights/ids [T, k] -> [T, H]."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    flat_ids = topk_ids.reshape(-1).long()  # [T * k]
    flat_weights = topk_weights.reshape(-1).float()
    for expert in flat_ids.unique().tolist():
        picks = (flat_ids == expert).nonzero().squeeze(1)  # [n] indices into T * k
        tokens = picks // topk_ids.shape[1]
        gate_up = hidden[tokens].float() @ w13[expert].float().t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        expert_out = act @ w2[expert].float().t()  # [n, H]
        out.index_add_(0, tokens, expert_out * flat_weights[picks, None])
    return out.to(hidden.dtype)


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]; fp32 arithmetic, result in hidden's dtype."""
    _check_inputs(hidden, w13, w2, router_logits, top_k)
    weights, ids = topk_route(router_logits, top_k, renormalize)
    return fused_moe_experts_reference(hidden, w13, w2, weights, ids)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    return fused_moe_reference(hidden, w13, w2, router_logits, top_k, renormalize)
