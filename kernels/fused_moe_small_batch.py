"""The MoE experts at a few (token, k) pairs (decode at small batch): matrix-vector products per pair, without the
sort by expert, and with the top-k routing folded into the first kernel (kernels in `_moe_small_batch_kernels`).

At one token Qwen3-30B-A3B's grouped path spent ~6.6 us a layer sorting 8 pairs (three launches) plus the top-k and
combine launches around two GEMMs that pad each expert's single row to a 16-row tile. Here a decode step's MoE is two
launches (three with `down_splits` > 1): routing + gate/up + SiLU * up, then down + weighted sum over the token's
pairs. Same arithmetic as the grouped path: fp32 accumulation, the intermediate rounded to the dtype, the weighted
sum over k in fp32 in k order. Callers validate the shapes (fused_moe's wrappers do); this checks what the kernels
assume of the memory layout.
"""

import torch
import triton

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._moe_small_batch_config import SmallBatchMoeConfig, down_splits, fit_tiles
from tidal.kernels._moe_small_batch_kernels import pair_gate_up_kernel, sum_splits_kernel, token_down_kernel
from tidal.kernels._validate import check_contiguous, check_dtype, check_shape


def _gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    top_k: int,
    config: SmallBatchMoeConfig,
    route: tuple[torch.Tensor, bool] | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """intermediate [T * k, I]; `route` (router logits [T, E], renormalize) routes in the kernel into weights/ids."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    tiles = fit_tiles(config.gate_up, inter, hidden_size)
    intermediate = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    logits, renormalize = route if route is not None else (weights, False)  # logits unused without routing
    pair_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, tiles.block_n))](
        hidden, w13, intermediate, logits, weights, ids,
        hidden_size, inter, num_experts, logits.stride(0),
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), EXPERTS_P2=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, ROUTE=route is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, **pdl_launch_options(hidden.device),
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
) -> None:
    num_tokens, hidden_size = out.shape
    inter = w2.shape[2]
    tiles = fit_tiles(config.down, hidden_size, inter)
    splits = down_splits(config, top_k)
    launch = pdl_launch_options(out.device)
    partial = (num_tokens * splits, hidden_size)
    target = out if splits == 1 else torch.empty(partial, dtype=torch.float32, device=out.device)  # [T * splits, H]
    token_down_kernel[(num_tokens * splits, triton.cdiv(hidden_size, tiles.block_n))](
        intermediate, w2, weights, ids, target, hidden_size, inter,
        PAIRS=top_k // splits, PAIRS_P2=triton.next_power_of_2(top_k // splits), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, **launch,
    )  # fmt: skip
    if splits > 1:
        block = min(triton.next_power_of_2(hidden_size), 1024)
        sum_splits_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
            target, out, hidden_size, SPLITS=splits, BLOCK=block, num_warps=4, **launch
        )


def _check_layout(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_contiguous(name, t)


def small_batch_moe_routed(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: SmallBatchMoeConfig,
) -> torch.Tensor:
    """hidden [T, H], router_logits [T, E] -> [T, H]: routing and experts, as fused_moe_reference computes them."""
    _check_layout(hidden, w13, w2)
    num_tokens = hidden.shape[0]
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=hidden.device)
    intermediate = _gate_up(hidden, w13, top_k, config, (logits, renormalize), weights, ids)
    _down(intermediate, w2, weights, ids, out, top_k, config)
    return out


def small_batch_moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: SmallBatchMoeConfig,
) -> torch.Tensor:
    """The experts for given routing (weights [T, k] fp32, ids [T, k] int32) -> [T, H] in hidden's dtype."""
    _check_layout(hidden, w13, w2)
    num_tokens, top_k = topk_ids.shape
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_contiguous("topk_ids", topk_ids)
    check_contiguous("topk_weights", topk_weights)
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    intermediate = _gate_up(hidden, w13, top_k, config, None, topk_weights, topk_ids)
    _down(intermediate, w2, topk_weights, topk_ids, out, top_k, config)
    return out
