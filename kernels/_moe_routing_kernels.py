# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels that prepare the MoE grouped GEMMs: top-k softmax routing, and sorting the (token, k) pairs by
expert into BLOCK_M-aligned segments so that every M-block of the GEMMs belongs to exactly one expert."""

import triton
import triton.language as tl


@triton.jit
def route_token(
    logits_row_ptr,
    num_experts,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token's routing: (weights [TOP_K_P2] fp32, expert ids [TOP_K_P2] int32), slots past TOP_K unused."""
    experts = tl.arange(0, EXPERTS_P2)
    logits = tl.load(logits_row_ptr + experts, mask=experts < num_experts, other=float("-inf"))
    logits = logits.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)  # [EXPERTS_P2], 0 for padding experts
    slots = tl.arange(0, TOP_K_P2)
    chosen_w = tl.zeros([TOP_K_P2], tl.float32)
    chosen_id = tl.zeros([TOP_K_P2], tl.int32)
    remaining = tl.where(experts < num_experts, probs, -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # Lowest index among equal maxima, like torch.topk on ties.
        best_id = tl.min(tl.where(remaining == best, experts, EXPERTS_P2), axis=0)
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_id = tl.where(slots == j, best_id, chosen_id)
        remaining = tl.where(experts == best_id, -1.0, remaining)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(tl.where(slots < TOP_K, chosen_w, 0.0), axis=0)
    return chosen_w, chosen_id


@triton.jit
def route_token_slot(
    logits_row_ptr,
    num_experts,
    slot,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """(weight fp32, expert int32) of one slot of one token's routing, for a kernel that routes before its first
    load. Up to 128 experts it ranks all of them at once: an expert's rank is how many come before it, by a higher
    logit or an equal one at a lower id (softmax keeps the order; only logits so close that their probabilities
    round equal may order differently from `route_token`, which compares probabilities). That is a few reductions
    instead of the ~2k of picking the top k one by one; the comparison runs RANK_CHUNK experts at a time to keep
    the [E, chunk] tile in registers."""
    RANK_CHUNK: tl.constexpr = 32
    if EXPERTS_P2 <= 128:
        experts = tl.arange(0, EXPERTS_P2)
        valid = experts < num_experts
        logits = tl.load(logits_row_ptr + experts, mask=valid, other=float("-inf")).to(tl.float32)
        rank = tl.zeros([EXPERTS_P2], tl.int32)  # 0 for the most probable
        for first in tl.static_range(0, EXPERTS_P2, RANK_CHUNK):
            others = first + tl.arange(0, RANK_CHUNK)
            theirs = tl.load(logits_row_ptr + others, mask=others < num_experts, other=float("-inf")).to(tl.float32)
            before = (theirs[None, :] > logits[:, None]) | (
                (theirs[None, :] == logits[:, None]) & (others[None, :] < experts[:, None])
            )  # [EXPERTS_P2, RANK_CHUNK]
            rank += tl.sum(before.to(tl.int32), axis=1)
        probs = tl.exp(logits - tl.max(logits, axis=0))
        probs = probs / tl.sum(probs, axis=0)  # [EXPERTS_P2], 0 for padding experts
        here = rank == slot
        weight = tl.sum(tl.where(here, probs, 0.0), axis=0)
        expert = tl.sum(tl.where(here, experts, 0), axis=0)
        if RENORMALIZE:
            weight = weight / tl.sum(tl.where(rank < TOP_K, probs, 0.0), axis=0)
    else:
        chosen_w, chosen_id = route_token(logits_row_ptr, num_experts, TOP_K, TOP_K_P2, EXPERTS_P2, RENORMALIZE)
        here = tl.arange(0, TOP_K_P2) == slot
        weight = tl.sum(tl.where(here, chosen_w, 0.0), axis=0)
        expert = tl.sum(tl.where(here, chosen_id, 0), axis=0)
    return weight, expert


@triton.jit
def topk_softmax_kernel(
    logits_ptr,
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int32
    logits_stride,
    num_experts,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    chosen_w, chosen_id = route_token(
        logits_ptr + token * logits_stride, num_experts, TOP_K, TOP_K_P2, EXPERTS_P2, RENORMALIZE
    )
    slots = tl.arange(0, TOP_K_P2)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_id, mask=slots < TOP_K)


# Sorting the pairs by expert takes three launches so that the per-pair work spreads over many programs: each chunk
# of CHUNK pairs counts its experts (expert_histogram_kernel), one program turns the counts into the padded segment
# layout and each chunk's first row per expert (expert_layout_kernel), and each chunk places its pairs
# (place_pairs_kernel). Pairs keep their order within an expert, so the placement is deterministic. A single
# program doing all of it walked the pairs serially: 93 us a layer for Qwen3-30B-A3B at batch 256 on an H200.


@triton.jit(do_not_specialize=["num_pairs"])  # per-batch counts: see grouped_gemm_kernel
def expert_histogram_kernel(
    ids_ptr,  # [N] int32 expert of each (token, k) pair, N = T * top_k
    chunk_counts_ptr,  # [num_chunks, EXPERTS_P2] int32 out: pairs of each expert in each chunk
    num_pairs,
    EXPERTS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = tl.arange(0, EXPERTS_P2)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * EXPERTS_P2 + experts, counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def expert_layout_kernel(
    chunk_counts_ptr,  # [num_chunks, EXPERTS_P2] int32 in; out: each chunk's first sorted row per expert
    sorted_pairs_ptr,  # [max_rows] int32 out: N (padding) in every used row; place_pairs_kernel fills the pairs in
    block_expert_ptr,  # [max_blocks] int32 out: expert of each M-block, -1 past the last used block
    num_pairs,
    num_chunks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    BLOCKS: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program. Only the rows of used blocks are written: the GEMMs stop at a block whose expert is -1."""
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros([EXPERTS_P2], tl.int32)
    for chunk in range(0, num_chunks):
        counts += tl.load(chunk_counts_ptr + chunk * EXPERTS_P2 + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    segment_end = tl.cumsum(padded, axis=0)  # [EXPERTS_P2]
    used_rows = tl.sum(padded, axis=0)

    cursor = segment_end - padded  # each expert's next free row, chunk after chunk
    for chunk in range(0, num_chunks):
        here = tl.load(chunk_counts_ptr + chunk * EXPERTS_P2 + experts)
        tl.store(chunk_counts_ptr + chunk * EXPERTS_P2 + experts, cursor)
        cursor += here

    lanes = tl.arange(0, BLOCKS)
    for start in range(0, max_blocks, BLOCKS):
        blocks = start + lanes
        first_row = blocks * BLOCK_M
        expert = tl.sum((segment_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < used_rows, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)
    fill_lanes = tl.arange(0, FILL)
    for start in range(0, used_rows, FILL):
        rows = start + fill_lanes
        tl.store(sorted_pairs_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=rows < used_rows)


@triton.jit(do_not_specialize=["num_pairs"])
def place_pairs_kernel(
    ids_ptr,  # [N] int32
    chunk_first_row_ptr,  # [num_chunks, EXPERTS_P2] int32: each chunk's first sorted row per expert
    sorted_pairs_ptr,  # [max_rows] int32 out: pair index of each sorted row
    pair_row_ptr,  # [N] int32 out: sorted row of each pair
    num_pairs,
    EXPERTS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = pairs < num_pairs
    experts = tl.arange(0, EXPERTS_P2)
    ids = tl.load(ids_ptr + pairs, mask=ok, other=-1)
    first_row = tl.load(chunk_first_row_ptr + chunk * EXPERTS_P2 + experts)  # [EXPERTS_P2]
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_P2]
    earlier_same = tl.cumsum(onehot, axis=0) - onehot  # pairs of the same expert before this one in the chunk
    row = tl.sum(onehot * (first_row[None, :] + earlier_same), axis=1)
    tl.store(sorted_pairs_ptr + row, pairs, mask=ok)
    tl.store(pair_row_ptr + pairs, row, mask=ok)
