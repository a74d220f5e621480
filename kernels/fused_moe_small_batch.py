"""The MoE experts at a few (token, k) pairs (decode at small batch): matrix-vector products per pair, without the
sort by expert, and with the top-k routing folded into the first kernel (kernels in `_moe_small_batch_kernels`).

At one token Qwen3-30B-A3B's grouped path spent ~6.6 us a layer sorting 8 pairs (three launches) plus the top-k and
combine launches around two GEMMs that pad each expert's single row to a 16-row tile. Here a decode step's MoE is two
launches: routing + gate/up + SiLU * up, then down + weighted sum over the token's pairs (with `down_splits` > 1
the last split of each output tile adds the others' partial sums in the same launch). Same arithmetic as the grouped
path: fp32 accumulation, the intermediate rounded to the dtype, the weighted sum over k in fp32 in k order. Callers
validate the shapes (fused_moe's wrappers do); this checks what the kernels assume of the memory layout.

`small_batch_moe_into_residual` is the decoder layer's form: it takes the post-attention RMSNorm's unscaled input
(`NormInput`) and returns the residual stream after the experts with the next norm's input, so the small-batch
decoder path (worker/models/decoder.py) runs a MoE layer with no RMSNorm launch of its own, as it runs a dense one.
Every entry point takes FP8 experts' `scales` (moe_expert_scales.py; None for 16-bit stacks).
"""

from typing import NamedTuple

import torch
import triton

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._moe_small_batch_config import SmallBatchMoeConfig, down_splits, fit_tiles
from tidal.kernels._moe_small_batch_kernels import pair_gate_up_kernel, token_down_kernel
from tidal.kernels._split_k import split_buffers
from tidal.kernels._validate import check_contiguous, check_dtype, check_shape
from tidal.kernels.moe_expert_scales import ExpertScales
from tidal.kernels.small_batch_linear import NormInput

# Partial sums of h^2 a program adds per step when it scales by 1/rms (the o projection writes up to H / 16 of them).
_BLOCK_P = 64


class _IntoResidual(NamedTuple):
    """Where the down pass adds its output: the residual stream [T, H] and the next RMSNorm's weight [H]."""

    residual: torch.Tensor
    next_gamma: torch.Tensor


def _gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    top_k: int,
    config: SmallBatchMoeConfig,
    route: tuple[torch.Tensor, bool] | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    norm: tuple[torch.Tensor, float] | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """intermediate [T * k, I]; `route` (router logits [T, E], renormalize) routes in the kernel into weights/ids;
    `norm` (partial sums of h^2 [P, T], eps): `hidden` is h * gamma, and the products are scaled by 1/rms(h)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    tiles = fit_tiles(config.gate_up, inter, hidden_size)
    intermediate = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    logits, renormalize = route if route is not None else (weights, False)  # logits unused without routing
    partials, eps = norm if norm is not None else (weights, 0.0)  # partials unused without the norm
    pair_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, tiles.block_n))](
        hidden, w13, scale if scale is not None else weights, intermediate, logits, weights, ids, partials,
        hidden_size, inter, num_experts, logits.stride(0), num_tokens, partials.shape[0] if norm else 0, eps,
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), EXPERTS_P2=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, ROUTE=route is not None, ROW_SCALE=norm is not None, W_SCALED=scale is not None,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_P=_BLOCK_P, STAGES=tiles.stages, num_warps=tiles.num_warps,
        **pdl_launch_options(hidden.device),
    )  # fmt: skip
    return intermediate


def _down(
    intermediate: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    config: SmallBatchMoeConfig,
    into: _IntoResidual | None = None,
    scale: torch.Tensor | None = None,
) -> NormInput:
    """Writes the output [T, H] into `out`, or with `into` residual + output; -> with `into` the next norm's input
    over that sum (h * gamma [T, H], sums of h^2 over each H-tile [tiles, T]), else empty tensors."""
    num_tokens, hidden_size = out.shape
    inter = w2.shape[2]
    tiles = fit_tiles(config.down, hidden_size, inter)
    splits = down_splits(config, top_k)
    h_tiles = triton.cdiv(hidden_size, tiles.block_n)
    workspace, counters = split_buffers(weights, num_tokens * h_tiles, splits, tiles.block_n)
    # The launch writes the next norm's input too: one partial sum per H-tile.
    scaled = torch.empty((num_tokens, hidden_size) if into else (0, 0), dtype=out.dtype, device=out.device)
    partial_sq = torch.empty((h_tiles if into else 0, num_tokens), dtype=torch.float32, device=out.device)
    residual, gamma = into if into is not None else (out, out)  # unused without `into`
    token_down_kernel[(num_tokens * splits, h_tiles)](
        intermediate, w2, scale if scale is not None else weights, weights, ids, out, residual, gamma, scaled,
        partial_sq, workspace, counters, num_tokens, hidden_size, inter, PAIRS=top_k // splits,
        PAIRS_P2=triton.next_power_of_2(top_k // splits), SPLITS=splits, INTO_RESIDUAL=into is not None,
        W_SCALED=scale is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
        num_warps=tiles.num_warps, **pdl_launch_options(out.device),
    )  # fmt: skip
    return NormInput(scaled, partial_sq)


def _check_layout(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None) -> None:
    for name, t in (
        ("hidden", hidden),
        ("w13", w13),
        ("w2", w2),
        *(() if scales is None else (("scales.w13", scales.w13), ("scales.w2", scales.w2))),
    ):
        check_contiguous(name, t)


def _scale(scales: ExpertScales | None, which: int) -> torch.Tensor | None:
    return None if scales is None else scales[which]


def small_batch_moe_routed(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: SmallBatchMoeConfig,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """hidden [T, H], router_logits [T, E] -> [T, H]: routing and experts, as fused_moe_reference computes them."""
    _check_layout(hidden, w13, w2, scales)
    num_tokens = hidden.shape[0]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=hidden.device)
    intermediate = _gate_up(hidden, w13, top_k, config, (logits, renormalize), weights, ids, scale=_scale(scales, 0))
    _down(intermediate, w2, weights, ids, out, top_k, config, scale=_scale(scales, 1))
    return out


def small_batch_moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: SmallBatchMoeConfig,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The experts for given routing (weights [T, k] fp32, ids [T, k] int32) -> [T, H] in hidden's dtype."""
    _check_layout(hidden, w13, w2, scales)
    num_tokens, top_k = topk_ids.shape
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_contiguous("topk_ids", topk_ids)
    check_contiguous("topk_weights", topk_weights)
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    intermediate = _gate_up(hidden, w13, top_k, config, None, topk_weights, topk_ids, scale=_scale(scales, 0))
    _down(intermediate, w2, topk_weights, topk_ids, out, top_k, config, scale=_scale(scales, 1))
    return out


class Routing(NamedTuple):
    """Routing done beforehand: weights [T * k] fp32 and expert ids [T * k] int32, flat."""

    weights: torch.Tensor
    ids: torch.Tensor


class RouterLogits(NamedTuple):
    """Routing to fold into the gate/up kernel: the router's logits [T, E] and whether top-k weights renormalise."""

    logits: torch.Tensor
    renormalize: bool


def small_batch_moe_into_residual(
    x: NormInput,
    eps: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing | RouterLogits,
    top_k: int,
    residual: torch.Tensor,
    next_gamma: torch.Tensor,
    config: SmallBatchMoeConfig,
    scales: ExpertScales | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """residual + experts(rms_norm(h)) for a few tokens, the norm given by its unscaled input `x` (h * gamma and sums
    of h^2) and `eps`. -> (the new residual stream [T, H], the input of the RMSNorm with weight `next_gamma` over
    it). `routing`: done (fused_moe routes in a launch of its own when the config does not fold it) or to fold in."""
    hidden = x.scaled
    _check_layout(hidden, w13, w2, scales)
    check_contiguous("residual", residual)
    check_shape("residual", residual, tuple(hidden.shape))
    check_shape("next_gamma", next_gamma, (hidden.shape[1],))
    check_contiguous("next_gamma", next_gamma)
    check_dtype("partial_sq", x.partial_sq, (torch.float32,))
    check_shape("partial_sq", x.partial_sq, (None, hidden.shape[0]))
    check_contiguous("partial_sq", x.partial_sq)
    num_tokens = hidden.shape[0]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out, NormInput(torch.empty_like(hidden), x.partial_sq.new_empty((0, 0)))
    if isinstance(routing, RouterLogits):
        logits = routing.logits if routing.logits.stride(1) == 1 else routing.logits.contiguous()
        weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=hidden.device)
        ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=hidden.device)
        route: tuple[torch.Tensor, bool] | None = (logits, routing.renormalize)
    else:
        weights, ids, route = routing.weights, routing.ids, None
    intermediate = _gate_up(hidden, w13, top_k, config, route, weights, ids, (x.partial_sq, eps), _scale(scales, 0))
    next_input = _down(
        intermediate, w2, weights, ids, out, top_k, config, _IntoResidual(residual, next_gamma), _scale(scales, 1)
    )
    return out, next_input
