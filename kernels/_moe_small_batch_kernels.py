# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the small-batch MoE path (wrapper: fused_moe_small_batch): matrix-vector products per (token, k)
pair, with no sort by expert. Each program reads its pair's expert id on the device, so the grid depends on the
batch size only (one variant per CUDA graph) and nothing waits on the host.

`pair_gate_up_kernel`: program (pair, N-tile) -> silu(gate) * up of BLOCK_N intermediate columns of that pair, over
the whole hidden size; with ROUTE it first routes the pair's token from the router logits (softmax, top-k), so the
top-k kernel is not a launch of its own. `token_down_kernel`: program (token, split, H-tile) -> the routing-weighted
sum over the token's pairs of this split of W2 @ intermediate, the pairs' weight tiles loaded side by side: with one
split it is the layer's output, written once, no atomics and no combine; with several (more programs in flight when a
batch has few tokens) each writes its fp32 partial sum and counts itself in on its (token, H-tile)'s counter, and the
split that arrives last adds the partials in split order and writes the output (kernels/_split_k.py): no summing
launch, and the same bits whichever split was last.

With ROW_SCALE the gate/up kernel reads an RMSNorm's unscaled input (h * gamma and partial sums of h^2, see
small_batch_linear.NormInput) and scales its products by each token's 1/rms; with INTO_RESIDUAL the kernel that
writes the layer's output adds it to the residual stream and writes the next norm's NormInput instead. A decoder
layer's MoE then needs no RMSNorm launch before or after it (`fused_moe_small_batch.small_batch_moe_into_residual`).

With W_SCALED the weights are e4m3 (moe_expert_scales.py), read as they are (half the bytes), widened to fp32 like
16-bit ones, and each output column's sum multiplied by its scale after the K loop.

Pairs (tokens) are grid axis 0, the fastest-varying, so programs reading the same N-tile of an expert two tokens
chose run at about the same time and the second read tends to come from L2.
"""

import triton
import triton.language as tl

from tidal.kernels._moe_routing_kernels import route_token_slot
from tidal.kernels._triton_utils import arrives_last, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def token_inv_rms(partials_ptr, num_partials, num_tokens, token, hidden_size, eps, BLOCK_P: tl.constexpr):
    """1 / rms of one token's row from the partial sums of squares [num_partials, num_tokens], added in order."""
    sum_sq = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_partials, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        sum_sq += tl.load(partials_ptr + ps * num_tokens + token, mask=ps < num_partials, other=0.0)
    return tl.rsqrt(tl.sum(sum_sq, axis=0) / hidden_size + eps)


@triton.jit
def store_into_residual(
    total,  # [BLOCK_N] fp32: this tile of the layer's output for one token
    token,
    tile,
    cols,
    col_ok,
    num_tokens,
    hidden_size,
    out_ptr,  # [T, H]: the new residual stream
    res,  # [BLOCK_N] fp32: this tile of the token's residual stream
    gamma,  # [BLOCK_N] fp32: this tile of the next norm's weight
    scaled_ptr,  # [T, H] h * gamma
    partial_sq_ptr,  # [tiles, T] fp32 sums of h^2 over each tile's columns
    writes,  # whether this program stores (the last split of a split tile)
):
    """h = residual + output, rounded twice as the unfused layer rounds (the output, then the sum), and the next
    norm's input: h * gamma and this tile's sum of h^2."""
    col_ok = col_ok & writes
    row = token * hidden_size + cols
    h = (total.to(out_ptr.dtype.element_ty).to(tl.float32) + res).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row, h, mask=col_ok)
    hf = tl.where(col_ok, h.to(tl.float32), 0.0)
    tl.store(scaled_ptr + row, (hf * gamma).to(scaled_ptr.dtype.element_ty), mask=col_ok)
    tl.store(partial_sq_ptr + tile * num_tokens + token, tl.sum(hf * hf, axis=0), mask=writes)


@triton.jit
def sum_splits_last(part, workspace_ptr, counters_ptr, tile, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes this split's fp32 partial [BLOCK_N] of `tile`, counts the split in on the tile's counter, and -> (the
    sum over all splits in split order, whether this split arrived last). Only the last one's sum is complete."""
    cell = tl.arange(0, BLOCK_N)
    tile_base = workspace_ptr + tile.to(tl.int64) * (SPLITS * BLOCK_N)
    tl.store(tile_base + split * BLOCK_N + cell, part)
    last = arrives_last(counters_ptr + tile, SPLITS)
    total = tl.zeros([BLOCK_N], tl.float32)
    for s in tl.static_range(SPLITS):
        # .cg: from L2, where the other programs' stores are, never a stale L1 line.
        total += tl.load(tile_base + s * BLOCK_N + cell, mask=last, other=0.0, cache_modifier=".cg")
    tl.store(counters_ptr + tile, 0, mask=last)  # ready for the next launch
    return total, last


@triton.jit
def pair_gate_up_kernel(
    hidden_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows
    w13_scale_ptr,  # W_SCALED: [E, 2I] fp32
    inter_ptr,  # [T * TOP_K, I] out, hidden's dtype
    logits_ptr,  # [T, E] router logits (ROUTE)
    weights_ptr,  # [T * TOP_K] fp32: written by N-tile 0 when ROUTE, else unused
    ids_ptr,  # [T * TOP_K] int32: written by N-tile 0 when ROUTE, else read
    norm_partials_ptr,  # [P, T] fp32 sums of the unscaled h^2 (ROW_SCALE: hidden is h * gamma)
    hidden_size,
    inter_size,
    num_experts,
    logits_stride,
    num_tokens,
    num_partials,
    eps,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUTE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the K loop (GemvTiles.stages)
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    pair = tl.program_id(0)
    n_tile = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    if ROUTE:
        # Every N-tile of the pair routes the token again (E logits, a few KB at most): cheaper than a launch.
        weight, expert = route_token_slot(
            logits_ptr + token * logits_stride, num_experts, pair % TOP_K, TOP_K, TOP_K_P2, EXPERTS_P2, RENORMALIZE
        )
        if n_tile == 0:
            tl.store(weights_ptr + pair, weight)
            tl.store(ids_ptr + pair, expert)
    else:
        expert = tl.load(ids_ptr + pair)

    if ROW_SCALE:
        # Before the weight loop, so its few registers are free again while the wide weight tiles are live.
        inv_rms = token_inv_rms(norm_partials_ptr, num_partials, num_tokens, token, hidden_size, eps, BLOCK_P)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + token * hidden_size + ks  # [BLOCK_K]
    gate_ptrs = (
        w13_ptr + expert.to(tl.int64) * (2 * inter_size * hidden_size) + cols[:, None].to(tl.int64) * hidden_size
    ) + ks[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = gate_ptrs + inter_size * hidden_size
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.range(0, hidden_size, BLOCK_K, num_stages=STAGES):
        k_ok = k + ks < hidden_size
        w_ok = col_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(gate_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        gate += tl.sum(g * x[None, :], axis=1)
        up += tl.sum(u * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    let_next_kernel_launch(USE_PDL)
    if W_SCALED:
        scale_ptrs = w13_scale_ptr + expert.to(tl.int64) * (2 * inter_size) + cols
        gate = gate * tl.load(scale_ptrs, mask=col_ok, other=0.0)
        up = up * tl.load(scale_ptrs + inter_size, mask=col_ok, other=0.0)
    if ROW_SCALE:
        gate = gate * inv_rms
        up = up * inv_rms
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, rounded to the dtype as the grouped path rounds it
    tl.store(inter_ptr + pair.to(tl.int64) * inter_size + cols, act.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def token_down_kernel(
    inter_ptr,  # [T * TOP_K, I]
    w2_ptr,  # [E, H, I]
    w2_scale_ptr,  # W_SCALED: [E, H] fp32
    weights_ptr,  # [T * TOP_K] fp32 routing weights
    ids_ptr,  # [T * TOP_K] int32 experts
    out_ptr,  # [T, H] in the output dtype
    residual_ptr,  # INTO_RESIDUAL: [T, H], and the next norm's gamma [H], h * gamma [T, H] and sums of h^2
    gamma_ptr,  # [H-tiles, T] out; out_ptr gets residual + output
    scaled_ptr,
    partial_sq_ptr,
    workspace_ptr,  # SPLITS > 1: [T * H-tiles, SPLITS, BLOCK_N] fp32 partial sums
    counters_ptr,  # SPLITS > 1: [>= T * H-tiles] int32 arrival counters, zero between launches
    num_tokens,
    hidden_size,
    inter_size,
    PAIRS: tl.constexpr,  # pairs per program: TOP_K // SPLITS
    PAIRS_P2: tl.constexpr,
    SPLITS: tl.constexpr,
    INTO_RESIDUAL: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the K loop (GemvTiles.stages)
    USE_PDL: tl.constexpr,
):
    """All PAIRS experts' tiles are loaded in one step of the K loop ([PAIRS, BLOCK_N, BLOCK_K]): a token's pairs
    stream side by side, so even one token keeps many loads in flight without a second launch."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)  # token * SPLITS + split
    h_tile = tl.program_id(1)
    slots = tl.arange(0, PAIRS_P2)
    slot_ok = slots < PAIRS
    pairs = row * PAIRS + slots  # [PAIRS_P2]
    experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    weights = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    cols = h_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * inter_size + ks[None, :]  # [PAIRS_P2, BLOCK_K]
    w_rows = experts[:, None] * hidden_size + cols[None, :].to(tl.int64)  # [PAIRS_P2, BLOCK_N]
    w_ptrs = w2_ptr + w_rows[:, :, None] * inter_size + ks[None, None, :]  # [PAIRS_P2, BLOCK_N, BLOCK_K]
    w_tile_ok = (slot_ok[:, None] & col_ok[None, :])[:, :, None]
    token = (row // SPLITS).to(tl.int64)
    if INTO_RESIDUAL:
        # Before the K loop, so these loads' round trip overlaps the weight stream instead of following it.
        res = tl.load(residual_ptr + token * hidden_size + cols, mask=col_ok, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([PAIRS_P2, BLOCK_N], tl.float32)
    for k in tl.range(0, inter_size, BLOCK_K, num_stages=STAGES):
        k_ok = k + ks < inter_size
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=w_tile_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    let_next_kernel_launch(USE_PDL)
    if W_SCALED:
        acc *= tl.load(w2_scale_ptr + w_rows, mask=slot_ok[:, None] & col_ok[None, :], other=0.0)  # [PAIRS_P2, N]
    total = tl.sum(acc * weights[:, None], axis=0)  # [BLOCK_N]: the weighted sum over the pairs, a fixed order
    writes = True
    if SPLITS > 1:
        tile = token * tl.num_programs(1) + h_tile
        total, writes = sum_splits_last(total, workspace_ptr, counters_ptr, tile, row % SPLITS, SPLITS, BLOCK_N)
    if INTO_RESIDUAL:
        store_into_residual(total, token, h_tile, cols, col_ok, num_tokens, hidden_size, out_ptr, res, gamma,
                            scaled_ptr, partial_sq_ptr, writes)  # fmt: skip
    else:
        tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok & writes)
