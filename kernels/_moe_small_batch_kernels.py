# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of the small-batch MoE path (wrapper: fused_moe_small_batch): matrix-vector products per (token, k)
pair, with no sort by expert. Each program reads its pair's expert id on the device, so the grid depends on the
batch size only (one variant per CUDA graph) and nothing waits on the host.

`pair_gate_up_kernel`: program (pair, N-tile) -> silu(gate) * up of BLOCK_N intermediate columns of that pair, over
the whole hidden size; with ROUTE it first routes the pair's token from the router logits (softmax, top-k), so the
top-k kernel is not a launch of its own. `token_down_kernel`: program (token, split, H-tile) -> the routing-weighted
sum over the token's pairs of this split of W2 @ intermediate, the pairs' weight tiles loaded side by side: with one
split it is the layer's output, written once, no atomics and no combine; with several each writes fp32 partial sums
that `sum_splits_kernel` adds in a fixed order (more programs in flight when a batch has few tokens, for one more
launch).

Pairs (tokens) are grid axis 0, the fastest-varying, so programs reading the same N-tile of an expert two tokens
chose run at about the same time and the second read tends to come from L2.
"""

import triton
import triton.language as tl

from tidal.kernels._moe_routing_kernels import route_token_slot
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def pair_gate_up_kernel(
    hidden_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]: gate rows, then up rows
    inter_ptr,  # [T * TOP_K, I] out, hidden's dtype
    logits_ptr,  # [T, E] router logits (ROUTE)
    weights_ptr,  # [T * TOP_K] fp32: written by N-tile 0 when ROUTE, else unused
    ids_ptr,  # [T * TOP_K] int32: written by N-tile 0 when ROUTE, else read
    hidden_size,
    inter_size,
    num_experts,
    logits_stride,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUTE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    for k in range(0, hidden_size, BLOCK_K):
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
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, rounded to the dtype as the grouped path rounds it
    tl.store(inter_ptr + pair.to(tl.int64) * inter_size + cols, act.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def token_down_kernel(
    inter_ptr,  # [T * TOP_K, I]
    w2_ptr,  # [E, H, I]
    weights_ptr,  # [T * TOP_K] fp32 routing weights
    ids_ptr,  # [T * TOP_K] int32 experts
    out_ptr,  # SPLITS == 1: [T, H] in the output dtype; else [T * SPLITS, H] fp32 partial sums
    hidden_size,
    inter_size,
    PAIRS: tl.constexpr,  # pairs per program: TOP_K // SPLITS
    PAIRS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    acc = tl.zeros([PAIRS_P2, BLOCK_N], tl.float32)
    for k in range(0, inter_size, BLOCK_K):
        k_ok = k + ks < inter_size
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=w_tile_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    let_next_kernel_launch(USE_PDL)
    total = tl.sum(acc * weights[:, None], axis=0)  # [BLOCK_N]: the weighted sum over the pairs, a fixed order
    tl.store(out_ptr + row.to(tl.int64) * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def sum_splits_kernel(
    partial_ptr,  # [T * SPLITS, H] fp32
    out_ptr,  # [T, H]
    hidden_size,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden_size
    total = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + (token * SPLITS + split) * hidden_size + cols, mask=ok, other=0.0)
    let_next_kernel_launch(USE_PDL)
    tl.store(out_ptr + token * hidden_size + cols, total.to(out_ptr.dtype.element_ty), mask=ok)
