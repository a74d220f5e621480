"""Paged decode attention (one new query token per sequence) over the block-table KV cache: the torch reference,
the Triton wrapper (kernels in `_decode_attention_kernels`) and the dispatching entry point."""

import math
import os

import torch
import triton

from tidal.kernels._attention_checks import check_paged_kv, check_seq_lens, gather_context
from tidal.kernels._decode_attention_kernels import LOG2E, decode_split_kernel
from tidal.kernels._device import multiprocessor_count, pdl_launch_options
from tidal.kernels._split_k import arrival_counters
from tidal.kernels.kv_layout import cache_strides, has_page_runs, is_tokens_innermost

# A split shorter than this spends more on the merge than it wins in parallelism.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# On an H200, batch 64 x 8 KV heads (512 programs, about 3.9 per multiprocessor) ran fastest unsplit.
PROGRAMS_PER_SM = 3
# Copies in flight per program. A tokens-innermost (FP8) V takes two: at three its loop compiled to more registers
# (fewer programs per multiprocessor) and ran 26% slower on an H200 (kv-cache-fp8-v-layout-h200.md).
STAGES = 3
TOKENS_INNER_V_STAGES = 2
# A tokens-innermost V over many unsplit programs takes 32-token tiles on 2 warps with one stage: small programs,
# more of them resident per multiprocessor to hide the paged gathers' latency. On an H100 (context 400) that ran
# 1.10x faster at batch 256 and 1.11x at batch 128 than (64 tokens, 4 warps, 2 stages); at batch 64 (~4 programs
# a multiprocessor) it did not win (kernels-h100-attention-fp8-sweep.txt, kernels-h100-attention-fp8-batches.txt).
MANY_PROGRAMS_PER_SM = 6
MANY_PROGRAMS_TILE = (32, 2, 1)  # block_n, num_warps, num_stages
# A launch of at most this many programs a multiprocessor reads each split's first tile before waiting for the
# previous kernel (`decode_split_kernel`'s EARLY_FIRST_TILE): its programs, resident while that kernel finishes, hold
# the tile through the wait. That takes 202 registers a thread where 128 did (Qwen3's FP8 cache on 4 warps;
# benchmarks/kernels/register_report.py), two programs a multiprocessor at most, so launches of more keep the plain
# loop. Qwen3-30B-A3B's FP8 batch-1 step on an H100 took 2,251 / 2,243 / 2,244 us with it against 2,282 / 2,281 /
# 2,273 / 2,272 without (profile-steps-qwen3-30b-a3b-h100-decode-early-tile-second-form.txt); its first form, which
# read the step's own token after the tiles, had been 1.5% slower. TIDAL_DECODE_EARLY_TILE=0 turns it off (A/B).
EARLY_FIRST_TILE_PROGRAMS_PER_SM = 2
_EARLY_FIRST_TILE_SWITCH = os.environ.get("TIDAL_DECODE_EARLY_TILE", "1") != "0"
# Splits the in-kernel merge loads per step: [group heads (>= 16), chunk, head_dim] fp32 stays in registers.
MERGE_CHUNK = 4


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    check_paged_kv(q, k_cache, v_cache, block_tables)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} sequences")
    check_seq_lens(seq_lens, q.shape[0], q.device)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, num_heads, head_dim] -> [B, num_heads, head_dim] in q's dtype; a sequence with seq_len 0 gives zeros."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        keys = gather_context(k_cache, block_tables[b], seq_len).float()  # [L, num_kv_heads, head_dim]
        values = gather_context(v_cache, block_tables[b], seq_len).float()
        keys = keys.repeat_interleave(group, dim=1)  # [L, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale  # [num_heads, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Enough (sequence, KV head, split) programs to give every multiprocessor about three, without splits so short
    that merging them costs more than it saves. Depends only on shapes, so it never syncs with the device."""
    programs = max(batch * num_kv_heads, 1)
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / programs)
    longest_useful = max(max_context // MIN_SPLIT_TOKENS, 1)
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


def default_tile(head_dim_p2: int, tokens_inner: bool) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of any launch `choose_tile` does not single out."""
    return (64 if head_dim_p2 <= 128 else 32), 4, (TOKENS_INNER_V_STAGES if tokens_inner else STAGES)


def choose_tile(
    programs: int, num_splits: int, head_dim_p2: int, tokens_inner: bool, num_sms: int
) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) for a launch of `programs` (sequence, KV head) pairs; shapes only."""
    if tokens_inner and num_splits == 1 and head_dim_p2 <= 128 and programs >= MANY_PROGRAMS_PER_SM * num_sms:
        return MANY_PROGRAMS_TILE
    return default_tile(head_dim_p2, tokens_inner)


def reads_first_tile_early(programs: int, num_splits: int, num_sms: int, switched_on: bool = True) -> bool:
    """Whether a launch of `programs` (sequence, KV head) pairs, each in `num_splits` splits, reads every split's
    first tile before its wait; shapes and the switch (TIDAL_DECODE_EARLY_TILE) only."""
    return switched_on and programs * num_splits <= EARLY_FIRST_TILE_PROGRAMS_PER_SM * num_sms


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    early_first_tile: bool | None = None,
) -> torch.Tensor:
    """The Triton kernels; same contract as `paged_decode_attention_reference`. `num_splits` > 1 splits each context
    into that many pieces (split-K); by default it is chosen from the shapes, and so are the tile's `block_n`,
    `num_warps` and `num_stages` (`choose_tile`; one given keeps the others' defaults) and `early_first_tile`
    (`reads_first_tile_early`). The last split to finish on a (sequence, KV head) merges them, in the same launch."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, num_heads, head_dim], dense
    if batch == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    num_sms = multiprocessor_count(q.device)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    head_dim_p2 = max(triton.next_power_of_2(head_dim), 16)
    tokens_inner = is_tokens_innermost(v_cache)
    if block_n is None and num_warps is None and num_stages is None:
        block_n, num_warps, num_stages = choose_tile(
            batch * num_kv_heads, num_splits, head_dim_p2, tokens_inner, num_sms
        )
    else:  # a sweep's tile: what it leaves unset is the plain default
        default_block_n, default_warps, default_stages = default_tile(head_dim_p2, tokens_inner)
        block_n = default_block_n if block_n is None else block_n
        num_warps = default_warps if num_warps is None else num_warps
        num_stages = default_stages if num_stages is None else num_stages
    if block_n < 16 or block_n & (block_n - 1):  # the partial last tile goes 16 tokens at a time
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if early_first_tile is None:
        early_first_tile = reads_first_tile_early(batch * num_kv_heads, num_splits, num_sms, _EARLY_FIRST_TILE_SWITCH)
    group = num_heads // num_kv_heads
    if num_splits > 1:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial, lse = out, out  # the kernel writes the final output directly
    counters = arrival_counters(q.device, batch * num_kv_heads) if num_splits > 1 else lse  # unused unsplit
    decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        out,
        counters,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *cache_strides(v_cache),
        block_tables.stride(0),
        scale * LOG2E,
        head_dim,
        GROUP=group,
        GROUP_P2=max(triton.next_power_of_2(group), 16),
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        V_LIKE_K=v_cache.stride() == k_cache.stride(),
        V_PAGE_RUNS=has_page_runs(v_cache),
        NUM_SPLITS=num_splits,
        MERGE_CHUNK=MERGE_CHUNK,
        IS_FP32=q.dtype == torch.float32,
        EARLY_FIRST_TILE=early_first_tile,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_options(q.device),
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    if q.is_cuda:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
