# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for paged decode attention: one program per (sequence, KV head, context split) computes all query
heads of that KV head's group at once, so each K/V tile is read from memory once for the whole group. With more than
one split the partial results are merged by their log-sum-exp in the split program that arrives last on its
(sequence, KV head) (an arrival counter as in kernels/_split_k.py): no second launch. A merge launch of its own cost
5.6 us a layer on an H200 at batch 1 (profile-steps-h200-decode-merge-in-kernel.txt)."""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import (
    arrives_last,
    exact_dot,
    let_next_kernel_launch,
    q_for_cache,
    wait_for_previous_kernel,
)

LOG2E = 1.4426950408889634


@triton.jit
def _merge_if_last(part_ptr, lse_ptr, out_ptr, counters_ptr, seq, kv_head, heads, row_ok, dims, dim_ok, num_heads,
                   head_dim, used_splits, GROUP_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   MERGE_CHUNK: tl.constexpr):  # fmt: skip
    """Counts this split in on its (sequence, KV head); the last to arrive merges the group's heads over the splits
    that saw tokens (`used_splits`: the rest hold nothing), MERGE_CHUNK splits per load, in split order."""
    counter = counters_ptr + seq * tl.num_programs(1) + kv_head
    last = arrives_last(counter, NUM_SPLITS)  # the partials and lse are stored
    rows = (seq * num_heads + heads) * NUM_SPLITS  # [GROUP_P2] first partial of each head
    chunk = tl.arange(0, MERGE_CHUNK)
    top = tl.full([GROUP_P2], float("-inf"), tl.float32)
    for s0 in range(0, used_splits, MERGE_CHUNK):
        ok = last & row_ok[:, None] & (s0 + chunk < used_splits)[None, :]
        lse = tl.load(lse_ptr + rows[:, None] + s0 + chunk[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, tl.max(lse, axis=1))
    top = tl.where(top > float("-inf"), top, 0.0)  # a head with no tokens: every weight becomes 0
    total = tl.zeros([GROUP_P2], tl.float32)
    merged = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    for s0 in range(0, used_splits, MERGE_CHUNK):
        ok = last & row_ok[:, None] & (s0 + chunk < used_splits)[None, :]
        lse = tl.load(lse_ptr + rows[:, None] + s0 + chunk[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        weights = tl.exp2(lse - top[:, None])  # [GROUP_P2, MERGE_CHUNK]
        total += tl.sum(weights, axis=1)
        part = part_ptr + (rows[:, None, None] + s0 + chunk[None, :, None]) * head_dim + dims[None, None, :]
        part_ok = ok[:, :, None] & dim_ok[None, None, :]
        parts = tl.load(part, mask=part_ok, other=0.0, cache_modifier=".cg")  # [GROUP_P2, MERGE_CHUNK, HEAD_DIM_P2]
        merged += tl.sum(parts * weights[:, :, None], axis=1)
    merged = merged / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = out_ptr + (seq * num_heads + heads[:, None]) * head_dim + dims[None, :]
    tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=last & row_ok[:, None] & dim_ok[None, :])
    tl.store(counter, 0, mask=last)  # ready for the next launch


@triton.jit
def _tile_addresses(k_cache_ptr, v_cache_ptr, table, tokens, end, k_head, v_head, dims, cache_stride_block,
                    cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, MASKED: tl.constexpr,
                    V_LIKE_K: tl.constexpr, V_PAGE_RUNS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """-> (K's row offsets [BLOCK_N], V's addresses, page_ok) of the tile `tokens` [BLOCK_N]: its page ids from the
    block table, and with V_PAGE_RUNS and MASKED which of its slots lie in the context's pages (`end`'s last one
    whole). K's addresses are made where they are loaded (_load_tile), as the plain loop was measured."""
    tok_ok = tokens < end
    if MASKED and V_PAGE_RUNS:
        # Whole pages: the last page's ids cover its slots past `end` too, so V's runs stay true to the hints below.
        page_ok = tokens // BLOCK_SIZE < tl.cdiv(end, BLOCK_SIZE)
        page = tl.load(table + tokens // BLOCK_SIZE, mask=page_ok, other=0).to(tl.int64)
    elif MASKED:
        page_ok = tok_ok
        page = tl.load(table + tokens // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    else:
        page_ok = tok_ok
        page = tl.load(table + tokens // BLOCK_SIZE).to(tl.int64)
    row = page * cache_stride_block + (tokens % BLOCK_SIZE) * cache_stride_offset  # [BLOCK_N]
    if V_LIKE_K:  # V laid out as K: K's addresses serve (64-bit address arithmetic once, not twice, per tile)
        v_at = v_cache_ptr + row[:, None] + k_head
    else:
        v_row = page * v_stride_block + (tokens % BLOCK_SIZE) * v_stride_offset + v_head
        if V_PAGE_RUNS:
            # A page's tokens lie side by side (kernels/kv_layout.py): aligned runs of min(BLOCK_N, BLOCK_SIZE),
            # which the compiler cannot see through the gathered page ids.
            RUN: tl.constexpr = min(BLOCK_N, BLOCK_SIZE)
            v_row = tl.max_contiguous(tl.multiple_of(v_row, RUN), RUN)
        v_at = v_cache_ptr + v_row[:, None] + dims[None, :] * v_stride_dim
    return row, v_at, page_ok


@triton.jit
def _load_tile(k_cache_ptr, row, k_head, v_at, tok_ok, page_ok, dim_ok, dtype, MASKED: tl.constexpr,
               V_PAGE_RUNS: tl.constexpr):  # fmt: skip
    """-> the tile's (K, V) in `dtype`, zeros where `tok_ok` is false (MASKED)."""
    kv_mask = tok_ok[:, None] & dim_ok[None, :] if MASKED else dim_ok[None, :]
    if MASKED and V_PAGE_RUNS:
        # V by whole pages, a mask that stays vectorised along a page's tokens (one that changed token by token
        # made the loads single bytes); the slots past the tokens wanted are then zeroed, since they may hold
        # anything, NaN included, and 0 x NaN is NaN.
        v = tl.load(v_at, mask=page_ok[:, None] & dim_ok[None, :], other=0.0).to(dtype)
        v = tl.where(tok_ok[:, None], v, tl.zeros_like(v))
    else:
        v = tl.load(v_at, mask=kv_mask, other=0.0).to(dtype)
    k = tl.load(k_cache_ptr + row[:, None] + k_head, mask=kv_mask, other=0.0).to(dtype)  # [BLOCK_N, HD_P2]
    return k, v


@triton.jit
def _accumulate(acc, m, denom, q, k, v, tok_ok, scale_log2, MASKED: tl.constexpr, IS_FP32: tl.constexpr,
                MAY_BE_EMPTY: tl.constexpr = False):  # fmt: skip
    """Online-softmax accumulation of one tile's K, V [BLOCK_N, HD_P2] for q's group, in q's dtype (a cache's FP8
    values converted exactly: see q_for_cache). A tile that MAY_BE_EMPTY (no token wanted, every score -inf) leaves
    the state as it was instead of making it NaN."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = exact_dot(q, tl.trans(k), IS_FP32)  # [GROUP_P2, BLOCK_N] fp32
    scores = scores * scale_log2
    if MASKED:
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
    m_new, alpha, p, denom = _softmax_step(m, denom, scores, MAY_BE_EMPTY)
    acc = acc * alpha[:, None] + exact_dot(p.to(v.dtype), v, IS_FP32)
    return acc, m_new, denom


@triton.jit
def _softmax_step(m, denom, scores, MAY_BE_EMPTY: tl.constexpr):
    """The online softmax's step over scores [GROUP_P2, N] (log2 domain) from the running max m and denominator:
    -> (the new max, alpha rescaling the old state, the probabilities p [GROUP_P2, N], the new denominator)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # Where every score so far is -inf (an empty tile), shifting by -inf would make -inf - -inf, NaN.
    m_shift = tl.where(m_new > float("-inf"), m_new, 0.0) if MAY_BE_EMPTY else m_new
    alpha = tl.exp2(m - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    return m_new, alpha, p, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tile(acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, tile, end, k_head, v_head, dims, dim_ok,
                 cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, scale_log2,
                 MASKED: tl.constexpr, V_LIKE_K: tl.constexpr, V_PAGE_RUNS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr):  # fmt: skip
    """Online-softmax accumulation over the tile of BLOCK_N tokens at `tile`. Unmasked tiles lie wholly before
    `end`: their loads have no token mask, which keeps a tokens-innermost V's loads vectorised along the tokens (a
    mask that changed token by token would split them into single bytes), and they read nothing past the context."""
    tokens = tl.multiple_of(tile, BLOCK_N) + tl.arange(0, BLOCK_N)  # [BLOCK_N]; tiles start on multiples of BLOCK_N
    tok_ok = tokens < end
    row, v_at, page_ok = _tile_addresses(
        k_cache_ptr, v_cache_ptr, table, tokens, end, k_head, v_head, dims, cache_stride_block, cache_stride_offset,
        v_stride_block, v_stride_offset, v_stride_dim, MASKED, V_LIKE_K, V_PAGE_RUNS, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    # An FP8 cache's values come back in q's dtype (exactly; fp16 then, see q_for_cache).
    k, v = _load_tile(k_cache_ptr, row, k_head, v_at, tok_ok, page_ok, dim_ok, q.dtype, MASKED, V_PAGE_RUNS)
    return _accumulate(acc, m, denom, q, k, v, tok_ok, scale_log2, MASKED, IS_FP32)


@triton.jit
def _newest_addresses(k_cache_ptr, v_cache_ptr, table, token, here, k_head, v_head, dims, cache_stride_block,
                      cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim,
                      BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """-> (K's, V's addresses) [1, HD_P2] of the single token at position `token` (its page looked up where
    `here`)."""
    page = tl.load(table + token // BLOCK_SIZE, mask=here, other=0).to(tl.int64)
    slot = token % BLOCK_SIZE
    k_at = k_cache_ptr + page * cache_stride_block + slot * cache_stride_offset + k_head
    v_at = v_cache_ptr + page * v_stride_block + slot * v_stride_offset + v_head + dims[None, :] * v_stride_dim
    return k_at, v_at


@triton.jit
def _accumulate_one(acc, m, denom, q, k, v, here, scale_log2):
    """One online-softmax update by a single token's K, V [1, HD_P2] where `here` (else the state is left as it
    was). Products and sums in fp32, of the same values the tiles' dot takes (q in the cache's compute type)."""
    score = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2  # [GROUP_P2]
    score = tl.where(here, score, float("-inf"))
    m_new, alpha, p, denom = _softmax_step(m, denom, score[:, None], True)  # no token yet and none here: may be empty
    acc = acc * alpha[:, None] + p * v.to(tl.float32)  # [GROUP_P2, 1] x [1, HD_P2]
    return acc, m_new, denom


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, H, D] when NUM_SPLITS == 1, else partial outputs [B, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [B, H, NUM_SPLITS] fp32 (log2 domain); unused when NUM_SPLITS == 1
    merged_ptr,  # [B, H, D] the merged output when NUM_SPLITS > 1
    counters_ptr,  # [>= B * KV heads] int32 arrival counters, zero between launches, when NUM_SPLITS > 1
    q_stride_b,
    q_stride_h,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    v_stride_block,
    v_stride_offset,
    v_stride_head,
    v_stride_dim,
    tables_stride,
    scale_log2,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_LIKE_K: tl.constexpr,  # V's strides are K's
    V_PAGE_RUNS: tl.constexpr,  # kv_layout.has_page_runs(V)
    NUM_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    IS_FP32: tl.constexpr,
    EARLY_FIRST_TILE: tl.constexpr,  # the split's first tile read before the wait (few programs: see the wrapper)
    USE_PDL: tl.constexpr,
):
    # The plain launch waits first. EARLY_FIRST_TILE first reads what no kernel of the step writes, and waits below:
    # the lengths and block tables are copied in before the step's first launch, which waits for them.
    wait_for_previous_kernel(USE_PDL and not EARLY_FIRST_TILE)
    let_next_kernel_launch(USE_PDL and not EARLY_FIRST_TILE)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence's own context is cut into NUM_SPLITS pieces of whole tiles. Cutting the padded table width
    # instead (what the host knows without a sync, and a CUDA graph's fixed width) would leave a short context in
    # one split while the others idle, and a decode step would wait on that split's serial tile loop.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.maximum(tl.minimum(seq_len, start + split_len), start)  # a split past the context: empty, not negative

    rows = tl.arange(0, GROUP_P2)  # query heads of this KV head's group (padded for the dot)
    dims = tl.arange(0, HEAD_DIM_P2)
    row_ok = rows < GROUP
    dim_ok = dims < head_dim
    heads = kv_head * GROUP + rows  # [GROUP_P2]
    if EARLY_FIRST_TILE:
        table = block_tables_ptr + seq * tables_stride
        k_head = kv_head * cache_stride_head + dims[None, :]
        v_head = kv_head * v_stride_head
        # The split's first tile, read before the wait while the previous kernel (the one storing this step's token)
        # finishes: every cached token but the newest (position seq_len - 1) was stored by an earlier step. The
        # tiles stop short of the newest, which is read after the wait on its own (_accumulate_one).
        tiles_end = tl.maximum(tl.minimum(end, seq_len - 1), start)
        # A split with no cached token (past the context, or holding only the newest) reads no page at all: its
        # first tile's pages would lie past the sequence's, where the table holds anything.
        first_end = tl.where(tiles_end > start, tiles_end, 0)
        first = tl.multiple_of(start, BLOCK_N) + tl.arange(0, BLOCK_N)
        first_ok = first < first_end
        first_row, first_v_at, first_page_ok = _tile_addresses(
            k_cache_ptr, v_cache_ptr, table, first, first_end, k_head, v_head, dims, cache_stride_block,
            cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, True, V_LIKE_K, V_PAGE_RUNS,
            BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
        # Held through the wait in the cache's dtype (an FP8 tile in half the registers of its 16-bit values).
        first_k, first_v = _load_tile(k_cache_ptr, first_row, k_head, first_v_at, first_ok, first_page_ok, dim_ok,
                                      k_cache_ptr.dtype.element_ty, True, V_PAGE_RUNS)  # fmt: skip
        # The newest token's page too (the table is no kernel's output): after the wait its K and V are one load.
        newest_here = (end > start) & (end == seq_len)
        newest_k_at, newest_v_at = _newest_addresses(
            k_cache_ptr, v_cache_ptr, table, tl.maximum(seq_len - 1, 0), newest_here, k_head, v_head, dims,
            cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, BLOCK_SIZE,
        )  # fmt: skip
    else:
        tiles_end = end
    wait_for_previous_kernel(USE_PDL and EARLY_FIRST_TILE)
    let_next_kernel_launch(USE_PDL and EARLY_FIRST_TILE)
    q = tl.load(
        q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [GROUP_P2, HEAD_DIM_P2]
    if EARLY_FIRST_TILE:  # in flight with q's
        newest_mask = newest_here & dim_ok[None, :]
        newest_k = tl.load(newest_k_at, mask=newest_mask, other=0.0)
        newest_v = tl.load(newest_v_at, mask=newest_mask, other=0.0)
    q = q_for_cache(q, k_cache_ptr, IS_FP32)

    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    if not EARLY_FIRST_TILE:  # here, as the plain launch was measured (the order of these sets its compiled code)
        table = block_tables_ptr + seq * tables_stride
        k_head = kv_head * cache_stride_head + dims[None, :]
        v_head = kv_head * v_stride_head
    if EARLY_FIRST_TILE:
        acc, m, denom = _accumulate(acc, m, denom, q, first_k, first_v, first_ok, scale_log2, True, IS_FP32, True)
        rest = start + BLOCK_N  # may lie past `tiles_end`: the loops below are then empty
    else:
        rest = start
    if V_PAGE_RUNS:
        # Whole tiles unmasked, then the split's partial last tile 16 tokens at a time: one masked tile of BLOCK_N
        # tokens here took ~60 more registers than the loop, for the whole kernel (kv-cache-fp8-v-layout-h200.md).
        full_end = start + (tiles_end - start) // BLOCK_N * BLOCK_N
        for tile in range(rest, full_end, BLOCK_N):
            acc, m, denom = _attend_tile(
                acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, tile, tiles_end, k_head, v_head, dims, dim_ok,
                cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, scale_log2,
                False, False, True, BLOCK_SIZE, BLOCK_N, IS_FP32,
            )  # fmt: skip
        # After a first tile read early, the partial tail starts past it even when that tile was partial.
        tail = tl.maximum(full_end, rest) if EARLY_FIRST_TILE else full_end
        for tile in range(tail, tiles_end, 16):
            acc, m, denom = _attend_tile(
                acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, tile, tiles_end, k_head, v_head, dims, dim_ok,
                cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, scale_log2,
                True, False, True, BLOCK_SIZE, 16, IS_FP32,
            )  # fmt: skip
    else:
        # V's head dims dense: a token mask keeps its loads vectorised, and one masked loop over every tile is as
        # fast as splitting off the last (a 16-bit V; kv-cache-fp8-v-layout-h200.md).
        for tile in range(rest, tiles_end, BLOCK_N):
            acc, m, denom = _attend_tile(
                acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, tile, tiles_end, k_head, v_head, dims, dim_ok,
                cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim, scale_log2,
                True, V_LIKE_K, False, BLOCK_SIZE, BLOCK_N, IS_FP32,
            )  # fmt: skip
    if EARLY_FIRST_TILE:
        acc, m, denom = _accumulate_one(acc, m, denom, q, newest_k, newest_v, newest_here, scale_log2)

    safe_l = tl.where(denom > 0, denom, 1.0)
    result = acc / safe_l[:, None]  # zeros where the split saw no token
    if NUM_SPLITS == 1:
        out_rows = out_ptr + (seq * num_heads + heads[:, None]) * head_dim + dims[None, :]
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [GROUP_P2]
        tl.store(out_ptr + part[:, None] * head_dim + dims[None, :], result, mask=row_ok[:, None] & dim_ok[None, :])
        lse = tl.where(denom > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
        used_splits = tl.where(split_len > 0, tl.cdiv(seq_len, tl.maximum(split_len, 1)), 0)  # the rest saw none
        _merge_if_last(out_ptr, lse_ptr, merged_ptr, counters_ptr, seq, kv_head, heads, row_ok, dims, dim_ok,
                       num_heads, head_dim, used_splits, GROUP_P2, HEAD_DIM_P2, NUM_SPLITS, MERGE_CHUNK)  # fmt: skip
