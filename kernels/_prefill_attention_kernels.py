# ruff: noqa: ANN001, ANN202 -- @triton.jit parameters stay unannotated: Triton reads annotations as specialisation hints.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel for causal prefill/extend attention over the paged KV cache (flash-attention style online softmax).

Grid: (tile slots, query-head groups), or its transpose. The new tokens of B sequences (packed) are cut per sequence
into tiles of BLOCK_M / Q_HEADS tokens; cdiv(T, tokens per tile) + B slots always suffice, and each program finds its
sequence from cu_seqlens_q on the device, so launching never needs the lengths on the host. Within a sequence the
tiles run last-first: the last tile sees the longest context, and starting the heaviest work first shortens the tail.
A sequence whose seq_len is 0 attends to nothing: its rows come out zero (see prefill_attention.py).
"""

import triton
import triton.language as tl

from tidal.kernels._triton_utils import exact_dot, q_for_cache


@triton.jit
def _attend_tile(
    acc,
    m,
    denom,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table,
    k_head,
    v_head,
    dims,
    dim_ok,
    positions,
    seq_len,
    kv_start,
    kv_end,
    cache_stride_block,
    cache_stride_offset,
    v_stride_block,
    v_stride_offset,
    v_stride_dim,
    scale_log2,
    CAUSAL_MASK: tl.constexpr,
    V_LIKE_K: tl.constexpr,
    V_PAGE_RUNS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    """Online-softmax accumulation over keys [kv_start, kv_end); CAUSAL_MASK only for tiles crossing the diagonal."""
    # The page ids of the next tile are loaded one iteration ahead: a load whose result feeds this iteration's K/V
    # addresses would make the pipeliner wait for every copy in flight before issuing the next ones.
    # Whole pages: a page that kv_end cuts through keeps its id in every lane, so V's page runs stay true to the
    # hints below (its slots past kv_end are masked on load all the same).
    num_pages = tl.cdiv(kv_end, BLOCK_SIZE)
    first_keys = kv_start + tl.arange(0, BLOCK_N)
    pages = tl.load(table + first_keys // BLOCK_SIZE, mask=first_keys // BLOCK_SIZE < num_pages, other=0)
    for tile in range(kv_start, kv_end, BLOCK_N):
        keys = tl.multiple_of(tile, BLOCK_N) + tl.arange(0, BLOCK_N)  # [BLOCK_N]; both ranges start on a tile
        key_ok = keys < kv_end
        row = pages.to(tl.int64) * cache_stride_block + (keys % BLOCK_SIZE) * cache_stride_offset
        if V_LIKE_K:  # K's addresses serve (as in decode: _decode_attention_kernels.py)
            v_at = v_cache_ptr + row[:, None] + k_head
        else:
            v_row = pages.to(tl.int64) * v_stride_block + (keys % BLOCK_SIZE) * v_stride_offset + v_head
            if V_PAGE_RUNS:  # a page's tokens lie side by side (as in decode)
                RUN: tl.constexpr = min(BLOCK_N, BLOCK_SIZE)
                v_row = tl.max_contiguous(tl.multiple_of(v_row, RUN), RUN)
            v_at = v_cache_ptr + v_row[:, None] + dims[None, :] * v_stride_dim
        next_keys = keys + BLOCK_N
        pages = tl.load(table + next_keys // BLOCK_SIZE, mask=next_keys // BLOCK_SIZE < num_pages, other=0)
        # Full tiles below the diagonal need no key mask (fewer predicates on the copies).
        kv_mask = key_ok[:, None] & dim_ok[None, :] if CAUSAL_MASK else dim_ok[None, :]
        # An FP8 cache's values come back in q's dtype (exactly; fp16 then, see q_for_cache), as in decode.
        k = tl.load(k_cache_ptr + row[:, None] + k_head, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, HD_P2]
        v = tl.load(v_at, mask=kv_mask, other=0.0).to(q.dtype)
        scores = exact_dot(q, tl.trans(k), IS_FP32)  # [BLOCK_M, BLOCK_N] fp32, unscaled
        if CAUSAL_MASK:
            visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] < seq_len)
            scores = scores * scale_log2 + tl.where(visible, 0.0, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            scores = scores - m_new[:, None]
        else:
            # Scaling folded into one multiply-add per score.
            m_new = tl.maximum(m, tl.max(scores, axis=1) * scale_log2)
            scores = scores * scale_log2 - m_new[:, None]
        p = tl.exp2(scores)
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = exact_dot(p.to(v.dtype), v, IS_FP32, acc * alpha[:, None])
        m = m_new
    return acc, m, denom


# Runtime sizes are not specialised on (divisible by 16, equal to 1): each new combination would compile the kernel
# again (~1 s on an H200) in the middle of serving, the first time a step's batch size crossed such a line.
@triton.jit(do_not_specialize=["batch", "tables_stride"])
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    out_ptr,  # [T, H, D] dense
    q_stride_t,
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
    batch,
    num_heads,
    head_dim,
    GROUP: tl.constexpr,
    Q_HEADS: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BATCH_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    V_LIKE_K: tl.constexpr,  # V's strides are K's
    V_PAGE_RUNS: tl.constexpr,  # kv_layout.has_page_runs(V)
    IS_FP32: tl.constexpr,
):
    # A tile is BLOCK_M rows = TOKENS new tokens x Q_HEADS query heads that share one KV head, so each K/V tile
    # loaded serves Q_HEADS heads.
    TOKENS: tl.constexpr = BLOCK_M // Q_HEADS
    if HEADS_FIRST:
        slot = tl.program_id(1)
        head_block = tl.program_id(0)
    else:
        slot = tl.program_id(0)
        head_block = tl.program_id(1)

    # Which sequence and which of its tiles this slot is: count the tiles of the sequences before it.
    seqs = tl.arange(0, BATCH_P2)
    starts = tl.load(cu_seqlens_ptr + seqs, mask=seqs < batch, other=0)
    ends = tl.load(cu_seqlens_ptr + seqs + 1, mask=seqs < batch, other=0)
    tiles = (ends - starts + TOKENS - 1) // TOKENS  # [BATCH_P2]
    tiles_end = tl.cumsum(tiles, axis=0)
    seq = tl.sum((tiles_end <= slot).to(tl.int32), axis=0)
    if seq >= batch:
        return
    is_seq = seqs == seq
    q_start = tl.sum(tl.where(is_seq, starts, 0), axis=0)
    q_len = tl.sum(tl.where(is_seq, ends - starts, 0), axis=0)
    seq_tiles = tl.sum(tl.where(is_seq, tiles, 0), axis=0)
    first_tile_slot = tl.sum(tl.where(is_seq, tiles_end - tiles, 0), axis=0)
    tile = seq_tiles - 1 - (slot - first_tile_slot)
    seq_len = tl.load(seq_lens_ptr + seq)

    lanes = tl.arange(0, BLOCK_M)
    rows = tile * TOKENS + lanes // Q_HEADS  # query index within the sequence's new tokens, per row
    heads = head_block * Q_HEADS + lanes % Q_HEADS  # [BLOCK_M]
    row_ok = rows < q_len
    positions = seq_len - q_len + rows  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_P2]
    q = q_for_cache(q, k_cache_ptr, IS_FP32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * tables_stride
    kv_head = head_block * Q_HEADS // GROUP
    k_head = kv_head * cache_stride_head + dims[None, :]
    v_head = kv_head * v_stride_head
    first_pos = seq_len - q_len + tile * TOKENS
    # A sequence with no context (seq_len 0: the padding of a step captured at a bucketed size) has only negative
    # positions; clamping both key ranges at 0 runs no tile for it, so its rows come out zero without a load.
    last_visible = tl.maximum(tl.minimum(first_pos + TOKENS, seq_len), 0)  # keys past this are masked for every row
    # Keys every row of the tile may see need no mask; only the tiles crossing the diagonal do.
    unmasked_end = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, 0)
    acc, m, denom = _attend_tile(
        acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, k_head, v_head, dims, dim_ok, positions, seq_len,
        0, unmasked_end, cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset, v_stride_dim,
        scale_log2, False, V_LIKE_K, V_PAGE_RUNS, BLOCK_SIZE, BLOCK_N, IS_FP32,
    )  # fmt: skip
    acc, m, denom = _attend_tile(
        acc, m, denom, q, k_cache_ptr, v_cache_ptr, table, k_head, v_head, dims, dim_ok, positions, seq_len,
        unmasked_end, last_visible, cache_stride_block, cache_stride_offset, v_stride_block, v_stride_offset,
        v_stride_dim, scale_log2, True, V_LIKE_K, V_PAGE_RUNS, BLOCK_SIZE, BLOCK_N, IS_FP32,
    )  # fmt: skip
    result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_rows = out_ptr + (tokens[:, None] * num_heads + heads[:, None]) * head_dim + dims[None, :]
    tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
