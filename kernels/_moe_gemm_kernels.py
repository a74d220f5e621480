# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for the MoE expert computation over rows sorted by expert (see `_moe_routing_kernels`).

`grouped_gemm_kernel` multiplies each BLOCK_M block of sorted rows by its expert's weight matrix. Pass 1
(GATE_UP=True) gathers the tokens' hidden rows and produces silu(gate) * up directly, so the [rows, 2I] product never
reaches memory; pass 2 multiplies by W2 and scales each row by its routing weight. `combine_kernel` then sums each
token's top_k rows in a fixed order (deterministic, no atomics).

With W_SCALED the weights are e4m3 (moe_expert_scales.py): each tile is widened to fp16 and multiplied with the
activations clamped to fp16 (as the dense small-batch kernels do: an H100 sweep found it 1-8% faster than widening
to bf16, 2-3% at 64 tokens, 8% at 1024), and the fp32 accumulators are multiplied by their columns' scales once,
after the K loop. fp32 activations keep fp32 products.

With SWAP_AB the K loop multiplies W's tile by the rows' (W @ rows^T) and transposes the product once at the end.
Same arithmetic, but the weight tile becomes the dot's first operand, which Hopper's wgmma takes from registers,
where a widened e4m3 tile is made anyway, and a BLOCK_M of 16 or 32 rows fills the instruction's N side. Compiled
for sm_90 with e4m3 weights and 16-row blocks, the unswapped loop becomes mma.sync and the swapped one wgmma with
the weights in registers (tests/kernels/test_register_report.py checks both). For grouped GEMMs with a few rows per
expert.

With A_SCALED as well (W8A8, for batches whose experts get many rows each: `_moe_config.quantizes_activations`) the
activations come quantized too, e4m3 rows with one fp32 scale each (pass 1: hidden's rows, by token; pass 2: the
sorted intermediate rows), and the dot runs on the FP8 tensor cores with no widening; the epilogue multiplies by
the row's and the column's scales.
"""

import triton
import triton.language as tl

from tidal.kernels._small_batch_kernels import beside_fp8
from tidal.kernels._triton_utils import exact_dot


# The row counts change with every batch: not specialised on (divisible by 16, equal to 1), so that a new batch size
# never compiles a new variant in the middle of serving (an expert-parallel group's step waits on it at a deadline).
@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def grouped_gemm_kernel(
    a_ptr,  # pass 1: hidden [T, K]; pass 2: intermediate [max_rows, K] in sorted order
    w_ptr,  # pass 1: w13 [E, 2N, K]; pass 2: w2 [E, N, K]
    w_scale_ptr,  # W_SCALED: pass 1 [E, 2N], pass 2 [E, N] fp32
    a_scale_ptr,  # A_SCALED: pass 1 [T], pass 2 [max_rows] fp32 (one per row of a)
    c_ptr,  # pass 1: intermediate [max_rows, N]; pass 2: expert outputs [max_rows, N] fp32
    sorted_pairs_ptr,
    block_expert_ptr,
    routing_weights_ptr,  # [num_pairs] fp32 (pass 2)
    num_pairs,
    max_blocks,
    N,
    K,
    a_stride,
    w_stride_e,
    w_stride_n,
    c_stride,
    w_scale_stride_e,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    W_SCALED: tl.constexpr,
    A_SCALED: tl.constexpr,  # a is e4m3 with a scale per row (W_SCALED too)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IS_FP32: tl.constexpr,
    SWAP_AB: tl.constexpr = False,  # multiply W @ rows^T (see the module's docstring)
):
    # Grouped ordering: GROUP_M consecutive M-blocks sweep the N tiles together, so weight tiles are reused from L2.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_tiles
    group_first = (pid // per_group) * GROUP_M
    group_size = tl.minimum(max_blocks - group_first, GROUP_M)
    m_block = group_first + (pid % per_group) % group_size
    n_tile = (pid % per_group) // group_size
    expert = tl.load(block_expert_ptr + m_block)
    if expert < 0:
        return

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted rows
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs  # padding rows carry the sentinel num_pairs
    # Pass 1 reads each pair's token row of hidden; pass 2 reads the sorted rows themselves.
    a_rows = (pairs // TOP_K).to(tl.int64) if GATE_UP else rows.to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    if SWAP_AB:
        # Transposed tiles: W's [BLOCK_N, BLOCK_K] (K contiguous, as stored) is the dot's first operand, the rows'
        # [BLOCK_K, BLOCK_M] its second; the product [BLOCK_N, BLOCK_M] is transposed once after the K loop.
        a_ptrs = a_ptr + a_rows[None, :] * a_stride + ks[:, None]  # [BLOCK_K, BLOCK_M]
        w_ptrs = w_base + cols[:, None].to(tl.int64) * w_stride_n + ks[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        a_ptrs = a_ptr + a_rows[:, None] * a_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_base + cols[None, :].to(tl.int64) * w_stride_n + ks[:, None]  # [BLOCK_K, BLOCK_N], W^T tile
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATE_UP:
        up_ptrs = w_ptrs + N * w_stride_n  # up rows follow the N gate rows
        acc_up = tl.zeros_like(acc)
    for k in range(0, K, BLOCK_K):
        a_mask, w_mask = _tile_masks(row_ok, col_ok, k + ks < K, SWAP_AB)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if W_SCALED and not A_SCALED:
            a = beside_fp8(a, IS_FP32)  # fp16, where e4m3 widens in one conversion (bf16 takes two)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if W_SCALED and not A_SCALED:
            w = w.to(a.dtype)  # exact: e4m3 values are fp16 values
        acc += _tile_product(a, w, IS_FP32 and not A_SCALED, SWAP_AB)
        if GATE_UP:
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            if W_SCALED and not A_SCALED:
                w_up = w_up.to(a.dtype)
            acc_up += _tile_product(a, w_up, IS_FP32 and not A_SCALED, SWAP_AB)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:  # back to [BLOCK_M, BLOCK_N] for the epilogue
        acc = tl.trans(acc)
        if GATE_UP:
            acc_up = tl.trans(acc_up)

    if W_SCALED:
        scale_ptrs = w_scale_ptr + expert.to(tl.int64) * w_scale_stride_e + cols
        acc *= tl.load(scale_ptrs, mask=col_ok, other=0.0)[None, :]
        if GATE_UP:
            acc_up *= tl.load(scale_ptrs + N, mask=col_ok, other=0.0)[None, :]
    if A_SCALED:
        row_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)[:, None]  # [BLOCK_M, 1]
        acc *= row_scale
        if GATE_UP:
            acc_up *= row_scale
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * c_stride + cols[None, :]
    if GATE_UP:
        act = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up; padding rows stay 0
        tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=col_ok[None, :])
    else:
        weight = tl.load(routing_weights_ptr + pairs, mask=row_ok, other=0.0)  # [BLOCK_M]
        tl.store(c_ptrs, (acc * weight[:, None]).to(c_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _tile_masks(row_ok, col_ok, k_ok, SWAP_AB: tl.constexpr):
    """(the rows' tile mask, the weight tile's mask) of one K step, in the orientation SWAP_AB loads them."""
    if SWAP_AB:
        return k_ok[:, None] & row_ok[None, :], col_ok[:, None] & k_ok[None, :]
    else:
        return row_ok[:, None] & k_ok[None, :], k_ok[:, None] & col_ok[None, :]


@triton.jit
def _tile_product(a, w, EXACT: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K step's product: rows @ W^T, or with SWAP_AB W @ rows^T (the weight tile as the dot's first operand)."""
    if SWAP_AB:
        return exact_dot(w, a, EXACT)
    else:
        return exact_dot(a, w, EXACT)


@triton.jit
def combine_kernel(
    expert_out_ptr,  # [max_rows, H] fp32, already scaled by routing weights
    pair_row_ptr,  # [T * TOP_K] int32
    out_ptr,  # [T, H]
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + token * TOP_K + j).to(tl.int64)
        total += tl.load(expert_out_ptr + row * hidden + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=ok)
