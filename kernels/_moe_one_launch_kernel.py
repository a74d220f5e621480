# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""The small-batch MoE's gate/up and down passes in one persistent launch (wrapper: fused_moe_small_batch, config:
`SmallBatchMoeConfig.one_launch`).

Two launches leave the memory system idle twice a layer: while gate/up's last programs finish (its tiles rarely
fill the machine evenly) and while the down kernel ramps up. Here a grid of a few programs per multiprocessor takes
work units from a queue (one atomic counter): first every gate/up unit (pair, N-tile), pair by pair, then every down
unit (token x split, H-tile), pair by pair too. A down unit loads its whole W2 tile (every column of the expert
width at once: the width must fit one K step, `fits_one_launch`) before it waits for its pairs' gate/up units to
have counted themselves in, so the down pass's weights stream while gate/up's last units still run.

Why it cannot deadlock: units are taken in queue order and a down unit waits only on gate/up units, which come
earlier in the queue and wait on nothing. Whichever programs took those are running, so they finish; with one
program (the interpreter runs programs one after another) every dependency is done before the unit that needs it.

Counters (one int32 each, in the device's arrival-counter buffer, kernels/_split_k.py): the queue, the programs that
have left, and one per pair counting its finished gate/up units. The last program to leave sets them all back to
zero for the next launch (a CUDA graph replays the kernel, not a zeroing). A gate/up unit's stores are published by
a barrier and a release count; a down unit reads the intermediate after an acquire and with .cg (from L2).
"""

import triton
import triton.language as tl

from tidal.kernels._moe_routing_kernels import route_token_slot
from tidal.kernels._moe_small_batch_kernels import down_epilogue, gate_up_tile, residual_tiles
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def _fewest_done(done_ptr, pairs, slot_ok, units_per_pair):
    """The fewest gate/up units any listed pair has finished (acquire: what they stored before counting is seen)."""
    counts = tl.atomic_add(done_ptr + pairs, 0, mask=slot_ok, sem="acquire", scope="gpu")
    return tl.min(tl.where(slot_ok, counts, units_per_pair), axis=0)


@triton.jit
def _down_unit(
    unit,
    inter_ptr,
    w2_ptr,
    w2_scale_ptr,
    logits_ptr,
    weights_ptr,
    ids_ptr,
    out_ptr,
    residual_ptr,
    gamma_ptr,
    scaled_ptr,
    partial_sq_ptr,
    workspace_ptr,
    counters_ptr,
    done_ptr,
    num_tokens,
    hidden_size,
    inter_size,
    num_experts,
    logits_stride,
    h_tiles,
    gate_up_units_per_pair,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUTE: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIRS_P2: tl.constexpr,
    SPLITS: tl.constexpr,
    INTO_RESIDUAL: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH_P2: tl.constexpr,  # the expert width rounded up to a power of two: one K step covers it
):
    """Down unit `unit` = (token * SPLITS + split) * h_tiles + H-tile: as a `token_down_kernel` program, but its
    weights are loaded before it waits for its pairs' intermediate."""
    row = unit // h_tiles
    h_tile = unit % h_tiles
    token = (row // SPLITS).to(tl.int64)
    slots = tl.arange(0, PAIRS_P2)
    slot_ok = slots < PAIRS
    pairs = row * PAIRS + slots  # [PAIRS_P2]
    if ROUTE:
        # The gate/up units route too and store what they chose, but waiting for that would delay the weight loads:
        # route again (the same arithmetic, so the same experts and weights).
        experts = tl.zeros([PAIRS_P2], tl.int64)
        weights = tl.zeros([PAIRS_P2], tl.float32)
        for slot in tl.static_range(PAIRS):
            weight, expert = route_token_slot(
                logits_ptr + token * logits_stride, num_experts, (row % SPLITS) * PAIRS + slot, TOP_K, TOP_K_P2,
                EXPERTS_P2, RENORMALIZE,
            )  # fmt: skip
            experts = tl.where(slots == slot, expert.to(tl.int64), experts)
            weights = tl.where(slots == slot, weight, weights)
    else:
        experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
        weights = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    cols = h_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    ks = tl.arange(0, WIDTH_P2)
    k_ok = ks < inter_size
    w_rows = experts[:, None] * hidden_size + cols[None, :].to(tl.int64)  # [PAIRS_P2, BLOCK_N]
    w_ok = (slot_ok[:, None] & col_ok[None, :])[:, :, None] & k_ok[None, None, :]
    w = tl.load(w2_ptr + w_rows[:, :, None] * inter_size + ks[None, None, :], mask=w_ok, other=0.0)
    res, gamma = residual_tiles(residual_ptr, gamma_ptr, token, cols, col_ok, hidden_size, INTO_RESIDUAL, BLOCK_N)

    done = _fewest_done(done_ptr, pairs, slot_ok, gate_up_units_per_pair)
    while done < gate_up_units_per_pair:
        done = _fewest_done(done_ptr, pairs, slot_ok, gate_up_units_per_pair)
    tl.debug_barrier()  # every thread reads the intermediate only after the count acquired it
    a_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * inter_size + ks[None, :]  # [PAIRS_P2, WIDTH_P2]
    a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)  # [PAIRS_P2, BLOCK_N]
    down_epilogue(acc, w_rows, slot_ok, col_ok, cols, weights, token, h_tile, h_tiles, row % SPLITS, w2_scale_ptr,
                  out_ptr, gamma, res, scaled_ptr, partial_sq_ptr, workspace_ptr, counters_ptr, num_tokens,
                  hidden_size, SPLITS, INTO_RESIDUAL, W_SCALED, BLOCK_N)  # fmt: skip


@triton.jit
def moe_one_launch_kernel(
    hidden_ptr,  # [T, H]; with ROW_SCALE h * gamma, and norm_partials_ptr its sums of h^2 [P, T]
    w13_ptr,  # [E, 2I, H]
    w13_scale_ptr,  # W_SCALED: [E, 2I] fp32
    w2_ptr,  # [E, H, I]
    w2_scale_ptr,  # W_SCALED: [E, H] fp32
    inter_ptr,  # [T * TOP_K, I] scratch between the passes
    logits_ptr,  # [T, E] (ROUTE)
    weights_ptr,  # [T * TOP_K] fp32: written when ROUTE, else read
    ids_ptr,  # [T * TOP_K] int32: written when ROUTE, else read
    norm_partials_ptr,
    out_ptr,  # [T, H]; with INTO_RESIDUAL residual + output, and the next norm's input in scaled / partial_sq
    residual_ptr,
    gamma_ptr,
    scaled_ptr,
    partial_sq_ptr,
    workspace_ptr,  # SPLITS > 1: the down pass's split sums (as token_down_kernel's)
    counters_ptr,  # SPLITS > 1: [>= T * h_tiles] zeroed arrival counters
    queue_ptr,  # [2] int32, zero: the next unit, the programs that have left
    done_ptr,  # [T * TOP_K] int32, zero: finished gate/up units per pair
    num_tokens,
    hidden_size,
    inter_size,
    num_experts,
    logits_stride,
    num_partials,
    eps,
    n_tiles,  # gate/up units per pair
    h_tiles,  # down units per (token, split)
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUTE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    W_SCALED: tl.constexpr,
    PAIRS: tl.constexpr,
    PAIRS_P2: tl.constexpr,
    SPLITS: tl.constexpr,
    INTO_RESIDUAL: tl.constexpr,
    GATE_UP_BLOCK_N: tl.constexpr,
    GATE_UP_BLOCK_K: tl.constexpr,
    GATE_UP_STAGES: tl.constexpr,
    DOWN_BLOCK_N: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    num_pairs = num_tokens * TOP_K
    gate_up_units = num_pairs * n_tiles
    units = gate_up_units + num_tokens * SPLITS * h_tiles
    unit = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    while unit < units:
        if unit < gate_up_units:
            pair = unit // n_tiles
            gate_up_tile(
                pair, unit % n_tiles, hidden_ptr, w13_ptr, w13_scale_ptr, inter_ptr, logits_ptr, weights_ptr,
                ids_ptr, norm_partials_ptr, hidden_size, inter_size, num_experts, logits_stride, num_tokens,
                num_partials, eps, TOP_K, TOP_K_P2, EXPERTS_P2, RENORMALIZE, ROUTE, ROW_SCALE, W_SCALED,
                GATE_UP_BLOCK_N, GATE_UP_BLOCK_K, BLOCK_P, GATE_UP_STAGES, False,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's stores are done before the count publishes them
            tl.atomic_add(done_ptr + pair, 1, sem="release", scope="gpu")
        else:
            _down_unit(
                unit - gate_up_units, inter_ptr, w2_ptr, w2_scale_ptr, logits_ptr, weights_ptr, ids_ptr, out_ptr,
                residual_ptr, gamma_ptr, scaled_ptr, partial_sq_ptr, workspace_ptr, counters_ptr, done_ptr,
                num_tokens, hidden_size, inter_size, num_experts, logits_stride, h_tiles, n_tiles, TOP_K, TOP_K_P2,
                EXPERTS_P2, RENORMALIZE, ROUTE, PAIRS, PAIRS_P2, SPLITS, INTO_RESIDUAL, W_SCALED, DOWN_BLOCK_N,
                WIDTH_P2,
            )  # fmt: skip
        unit = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    let_next_kernel_launch(USE_PDL)
    # Every program takes one unit past the end before it leaves, so the last to leave knows no one touches the
    # queue or the pairs' counters again in this launch.
    left = tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == tl.num_programs(0) - 1:
        tl.store(queue_ptr, 0)
        tl.store(queue_ptr + 1, 0)
        for first in range(0, num_pairs, BLOCK_P):
            cells = first + tl.arange(0, BLOCK_P)
            tl.store(done_ptr + cells, 0, mask=cells < num_pairs)
