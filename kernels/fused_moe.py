"""Fused mixture-of-experts: top-k softmax routing, the torch reference expert loop, the Triton path (token sorting by
expert + grouped GEMMs, kernels in `_moe_routing_kernels` and `_moe_gemm_kernels`) and the dispatching entry point.
A few (token, k) pairs take the small-batch path instead (`fused_moe_small_batch`), chosen from the static shapes
(`_moe_small_batch_config`); TIDAL_MOE_SMALL_BATCH=0 turns it off (A/B timing against the grouped GEMMs).

Weights: w13 [E, 2*I, H] (gate rows, then up rows), w2 [E, H, I]. out [T, H] = sum_k w_k * W2_e(silu(W1_e x) * W3_e x).
FP8 experts: e4m3 stacks with their `ExpertScales` (moe_expert_scales.py), which every entry point takes as `scales`.
"""

import os

import torch
import torch.nn.functional as F
import triton

from tidal.kernels._moe_config import (
    GemmTiles,
    MoeConfig,
    default_moe_config,
    quantizes_activations,
    tuned_moe_config,
)
from tidal.kernels._moe_gemm_kernels import combine_kernel, grouped_gemm_kernel
from tidal.kernels._moe_routing_kernels import (
    expert_histogram_kernel,
    expert_layout_kernel,
    place_pairs_kernel,
    topk_softmax_kernel,
)
from tidal.kernels._moe_small_batch_config import SmallBatchMoeConfig, small_batch_moe_config
from tidal.kernels._validate import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_same_device,
    check_shape,
)
from tidal.kernels.fp8_linear import quantize_rows_reference, quantize_rows_triton
from tidal.kernels.fused_moe_small_batch import (
    RouterLogits,
    Routing,
    small_batch_moe_experts,
    small_batch_moe_into_residual,
    small_batch_moe_routed,
)
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.moe_expert_scales import ExpertScales, check_expert_weights
from tidal.kernels.small_batch_linear import NormInput

# Triton's dot on 8-bit operands takes K tiles of 32 or more (an sm_90 compile refuses 16; the interpreter does not).
FP8_DOT_MIN_K = 32
# Either path's tiles; None picks the path and its tiles from the shapes.
AnyMoeConfig = MoeConfig | SmallBatchMoeConfig | None


def _check_routing(router_logits: torch.Tensor, top_k: int) -> None:
    check_ndim("router_logits", router_logits, 2)
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")


def topk_route_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32): softmax then top-k."""
    _check_routing(router_logits, top_k)
    probs = router_logits.float().softmax(dim=-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; same contract as `topk_route_reference`."""
    _check_routing(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens > 0:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        topk_softmax_kernel[(num_tokens,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            num_experts,
            TOP_K=top_k,
            TOP_K_P2=triton.next_power_of_2(top_k),
            EXPERTS_P2=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            num_warps=1 if num_experts <= 256 else 4,
        )
    return weights, ids


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA, the torch reference elsewhere."""
    if router_logits.is_cuda:
        return topk_route_triton(router_logits, top_k, renormalize)
    return topk_route_reference(router_logits, top_k, renormalize)


def _check_inputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    scales: ExpertScales | None = None,
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
    check_expert_weights(hidden, w13, w2, scales)
    check_same_device("hidden, w13, w2 and router_logits", hidden, w13, w2, router_logits)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")


def fused_moe_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: ExpertScales | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """The expert computation for given routing: hidden [T, H], topk_weights/ids [T, k] -> [T, H]. FP8 stacks'
    products are scaled per output channel after the product, in the kernels' order. `fp8_activations` (FP8 stacks
    only): as the W8A8 grouped GEMMs compute it, hidden's rows and the intermediate's rows (rounded to hidden's
    dtype first, as the kernels store it) quantized to e4m3 with a scale per row."""
    if fp8_activations and scales is None:
        raise ValueError("fp8_activations is for FP8 experts: scales are needed")
    rows = _through_e4m3(hidden) if fp8_activations else hidden  # what the products read
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    flat_ids = topk_ids.reshape(-1).long()  # [T * k]
    flat_weights = topk_weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero().squeeze(1)  # [n] indices into T * k
        tokens = picks // topk_ids.shape[1]
        gate_up = rows[tokens].float() @ w13[expert].float().t()  # [n, 2I]
        if scales is not None:
            gate_up = gate_up * scales.w13[expert]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        if fp8_activations:
            act = _through_e4m3(act.to(hidden.dtype))
        expert_out = act @ w2[expert].float().t()  # [n, H]
        if scales is not None:
            expert_out = expert_out * scales.w2[expert]
        out.index_add_(0, tokens, expert_out * flat_weights[picks, None])
    return out.to(hidden.dtype)


def _through_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the W8A8 kernels see it: quantized per row to e4m3, then back to fp32."""
    q, scale = quantize_rows_reference(x)
    return q.float() * scale[:, None]


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]; fp32 arithmetic, result in hidden's dtype."""
    _check_inputs(hidden, w13, w2, router_logits, top_k, scales)
    weights, ids = topk_route_reference(router_logits, top_k, renormalize)
    return fused_moe_experts_reference(hidden, w13, w2, weights, ids, scales)


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: AnyMoeConfig = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The Triton path; same contract as `fused_moe_reference`. A `MoeConfig` runs the grouped GEMMs with its tiles,
    a `SmallBatchMoeConfig` the small-batch path; None chooses by shape."""
    _check_inputs(hidden, w13, w2, router_logits, top_k, scales)
    if config is None:
        config = auto_small_batch_config(hidden.shape[0], top_k, w13)
    if isinstance(config, SmallBatchMoeConfig) and config.fold_routing:
        return small_batch_moe_routed(hidden, w13, w2, router_logits, top_k, renormalize, config, scales)
    weights, ids = topk_route_triton(router_logits, top_k, renormalize)
    if isinstance(config, SmallBatchMoeConfig):
        return small_batch_moe_experts(hidden, w13, w2, weights, ids, config, scales)
    return fused_moe_experts_triton(
        hidden, w13, w2, weights, ids, config, allow_small_batch=False, scales=scales
    )  # the path was decided above


def fused_moe_into_residual_reference(
    x: NormInput,
    eps: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor,
    next_gamma: torch.Tensor,
    scales: ExpertScales | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """The decoder layer's MoE from the post-attention norm's unscaled input `x`: normed = rms_norm(h) rounded to the
    dtype, h' = residual + fused_moe(normed) -> (h', the input of the norm with weight `next_gamma` over h', one
    partial sum per row). The Triton form scales products by 1/rms instead of rounding the normed h first: the two
    agree to the dtype's precision, not bit for bit."""
    inv_rms = torch.rsqrt(x.partial_sq.sum(dim=0) / x.scaled.shape[1] + eps)  # [T]
    normed = (x.scaled.float() * inv_rms[:, None]).to(x.scaled.dtype)
    out = fused_moe_reference(normed, w13, w2, router_logits, top_k, renormalize, scales)  # rounded to the dtype
    h = (out.float() + residual.float()).to(out.dtype)  # rounded as the unfused residual add rounds it
    hf = h.float()
    return h, NormInput((hf * next_gamma.float()).to(h.dtype), (hf * hf).sum(dim=1)[None, :].contiguous())


def fused_moe_into_residual_triton(
    x: NormInput,
    eps: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor,
    next_gamma: torch.Tensor,
    config: SmallBatchMoeConfig,
    scales: ExpertScales | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """The small-batch kernels, same contract as `fused_moe_into_residual_reference` (partial sums per H-tile);
    `router_logits` are the logits of the normed h (the router's own projection scales by 1/rms too)."""
    _check_inputs(x.scaled, w13, w2, router_logits, top_k, scales)
    routing: Routing | RouterLogits = RouterLogits(router_logits, renormalize)
    if not config.fold_routing:
        weights, ids = topk_route_triton(router_logits, top_k, renormalize)
        routing = Routing(weights.reshape(-1), ids.reshape(-1))
    return small_batch_moe_into_residual(x, eps, w13, w2, routing, top_k, residual, next_gamma, config, scales)


def auto_small_batch_config(num_tokens: int, top_k: int, w13: torch.Tensor) -> SmallBatchMoeConfig | None:
    """The small-batch config where this batch takes that path, else None. Static shapes only, so a CUDA graph
    captured for a batch size runs one path; TIDAL_MOE_SMALL_BATCH=0 (read per call, so a benchmark can switch it
    between runs in one process) keeps every batch on the grouped GEMMs."""
    if os.environ.get("TIDAL_MOE_SMALL_BATCH", "1") == "0":
        return None
    num_experts, two_inter, hidden_size = w13.shape
    fp8_experts = w13.dtype == FP8_E4M3
    return small_batch_moe_config(num_tokens, top_k, num_experts, hidden_size, two_inter // 2, fp8_experts)


def align_chunk(num_pairs: int, experts_p2: int) -> int:
    """Pairs per program of the alignment kernels: a [CHUNK, experts] one-hot of at most 4K elements, and no wider
    than the batch needs."""
    return int(min(max(triton.next_power_of_2(num_pairs), 16), max(4096 // experts_p2, 16)))


def sort_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(sorted_pairs [max_rows], block_expert [max_blocks], pair_row [N], max_blocks) for the grouped GEMMs: the
    (token, k) pairs sorted by expert into segments padded to block_m rows (see _moe_routing_kernels.py)."""
    num_pairs = topk_ids.numel()
    # Each expert's segment is padded up to a multiple of block_m: at most num_experts * (block_m - 1) extra rows.
    max_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    experts_p2 = triton.next_power_of_2(num_experts)
    chunk = align_chunk(num_pairs, experts_p2)
    num_chunks = triton.cdiv(num_pairs, chunk)
    chunk_rows = torch.empty(num_chunks, experts_p2, dtype=torch.int32, device=device)
    expert_histogram_kernel[(num_chunks,)](topk_ids, chunk_rows, num_pairs, EXPERTS_P2=experts_p2, CHUNK=chunk)
    expert_layout_kernel[(1,)](
        chunk_rows, sorted_pairs, block_expert, num_pairs, num_chunks, max_blocks,
        BLOCK_M=block_m, EXPERTS_P2=experts_p2, BLOCKS=max(4096 // experts_p2, 16), FILL=1024, num_warps=4,
    )  # fmt: skip
    place_pairs_kernel[(num_chunks,)](
        topk_ids, chunk_rows, sorted_pairs, pair_row, num_pairs, EXPERTS_P2=experts_p2, CHUNK=chunk
    )
    return sorted_pairs, block_expert, pair_row, max_blocks


def fused_moe_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: AnyMoeConfig = None,
    allow_small_batch: bool = True,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The expert computation for given routing (weights [T, k] fp32, ids [T, k] int32) -> [T, H] in hidden's dtype.
    `config` as for `fused_moe_triton`; without one, `allow_small_batch=False` keeps the grouped GEMMs."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    check_shape("topk_ids", topk_ids, (num_tokens, None))
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    for name, t in (
        ("hidden", hidden),
        ("w13", w13),
        ("w2", w2),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ):
        check_contiguous(name, t)
    check_expert_weights(hidden, w13, w2, scales)
    if config is None and allow_small_batch:
        config = auto_small_batch_config(num_tokens, top_k, w13)
    if isinstance(config, SmallBatchMoeConfig):
        return small_batch_moe_experts(hidden, w13, w2, topk_weights, topk_ids, config, scales)
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    w8a8 = scales is not None and quantizes_activations(num_tokens, top_k, num_experts)
    # Tiles by the activations' width: an FP8 weight tile takes half a 16-bit one's shared memory, so the 16-bit
    # tiles (the swept ones) always fit; an FP8 sweep on an H100 found the same best at 256 tokens
    # (benchmarks/results/fp8-weights-h100.md).
    element_size = max(hidden.element_size(), w13.element_size())
    if config is None and w8a8:
        config = default_moe_config(num_tokens, top_k, num_experts, element_size=1, fp8_activations=True)
    config = config or tuned_moe_config(
        num_tokens, top_k, num_experts, hidden_size, inter, element_size, fp8_experts=scales is not None
    )
    if w8a8 and min(config.gate_up.block_k, config.down.block_k) < FP8_DOT_MIN_K:
        raise ValueError(
            f"W8A8 grouped GEMMs need K tiles of at least {FP8_DOT_MIN_K} (e4m3 dots), got {config.gate_up.block_k} "
            f"and {config.down.block_k}"
        )
    num_pairs = num_tokens * top_k
    block_m = config.block_m
    sorted_pairs, block_expert, pair_row, max_blocks = sort_pairs_by_expert(topk_ids, num_experts, block_m)
    max_rows = max_blocks * block_m
    device = hidden.device
    intermediate = torch.empty(max_rows, inter, dtype=hidden.dtype, device=device)  # silu(gate) * up, sorted rows
    expert_out = torch.empty(max_rows, hidden_size, dtype=torch.float32, device=device)
    w13_scale, w2_scale = scales if scales is not None else (expert_out, expert_out)  # unused for 16-bit stacks

    def grouped_gemm(
        a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, c: torch.Tensor, n: int, k: int, tiles: GemmTiles,
        gate_up: bool,
    ) -> None:  # fmt: skip
        a_scale = expert_out  # unused unless W8A8
        if w8a8:
            a, a_scale = quantize_rows_triton(a)  # e4m3 rows and their scales, for the FP8 tensor cores
        grid = (max_blocks * triton.cdiv(n, tiles.block_n),)
        grouped_gemm_kernel[grid](
            a,
            w,
            w_scale,
            a_scale,
            c,
            sorted_pairs,
            block_expert,
            topk_weights,
            num_pairs,
            max_blocks,
            n,
            k,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            c.stride(0),
            w_scale.stride(0),
            TOP_K=top_k,
            GATE_UP=gate_up,
            W_SCALED=scales is not None,
            A_SCALED=w8a8,
            BLOCK_M=block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            GROUP_M=config.group_m,
            IS_FP32=hidden.dtype == torch.float32,
            SWAP_AB=tiles.swap_ab,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )

    grouped_gemm(hidden, w13, w13_scale, intermediate, inter, hidden_size, config.gate_up, True)
    grouped_gemm(intermediate, w2, w2_scale, expert_out, hidden_size, inter, config.down, False)
    block = min(triton.next_power_of_2(hidden_size), 1024)
    combine_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        expert_out, pair_row, out, hidden_size, TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    if hidden.is_cuda:
        return fused_moe_triton(hidden, w13, w2, router_logits, top_k, renormalize, scales=scales)
    return fused_moe_reference(hidden, w13, w2, router_logits, top_k, renormalize, scales)
