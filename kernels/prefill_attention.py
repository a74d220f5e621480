"""Causal prefill/extend attention over the paged KV cache (new tokens of several sequences packed, each possibly
after a cached prefix): the torch reference, the Triton wrapper and the dispatching entry point."""

from dataclasses import dataclass

import torch
import triton

from tidal.kernels._attention_checks import check_paged_kv, check_seq_lens, gather_context
from tidal.kernels._decode_attention_kernels import LOG2E
from tidal.kernels._prefill_attention_kernels import prefill_kernel
from tidal.kernels._validate import check_dtype, check_ndim
from tidal.kernels.kv_layout import cache_strides, has_page_runs

# The sequence lookup costs the same at 256 lanes as at 16 next to a prefill tile's work; 256 covers the usual
# max_num_seqs with a single compiled kernel.
MIN_BATCH_LANES = 256


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows per tile: block_m / q_heads tokens x q_heads query heads
    block_n: int
    num_warps: int
    num_stages: int
    q_heads: int = 1  # query heads of one KV group packed into a tile (they share its K/V loads)
    heads_first: bool = False  # grid order: heads vary fastest (else tiles of one head run together)


def default_config(head_dim: int, group: int) -> PrefillConfig:
    """Tile shapes by head size: the query tile and one K/V tile per pipeline stage must fit shared memory. Two query
    heads of a GQA group share each tile (and its K/V loads) when the group allows: about 4% faster on an H200
    (benchmarks/results/kernels-h200.md)."""
    q_heads = 2 if group % 2 == 0 else 1
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, q_heads=q_heads)
    if head_dim <= 128:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, q_heads=q_heads)
    return PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, q_heads=q_heads)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    check_paged_kv(q, k_cache, v_cache, block_tables)
    batch = block_tables.shape[0]
    check_ndim("cu_seqlens_q", cu_seqlens_q, 1)
    check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must have {batch + 1} entries for {batch} sequences, got {cu_seqlens_q.numel()}"
        )
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q must be on {q.device}, got {cu_seqlens_q.device}")
    check_seq_lens(seq_lens, batch, q.device)


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, num_heads, head_dim] -> [T, num_heads, head_dim]. The i-th new token of sequence b sits at position
    seq_lens[b] - q_len_b + i and sees keys 0..that position. A sequence with seq_lens[b] == 0 has no context: its
    rows attend to nothing and come out zero (a captured step's padding tokens, prefill_graphs.py). Rows of no
    sequence (past cu_seqlens_q[-1]) come out zero here and are left unwritten by the kernel."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len <= 0 or seq_len == 0:
            continue
        if seq_len < q_len:
            raise ValueError(f"sequence {b}: seq_len {seq_len} is shorter than its {q_len} new tokens")
        keys = gather_context(k_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        values = gather_context(v_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [num_heads, q_len, seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
        key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


def batch_lanes(batch: int) -> int:
    """Lanes of the kernel's sequence lookup: a power of two, at least MIN_BATCH_LANES so that one compiled kernel
    serves every batch of up to that many sequences (a constexpr: each new value compiles the kernel again)."""
    lanes: int = triton.next_power_of_2(batch)  # triton is untyped
    return max(MIN_BATCH_LANES, lanes)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel; same contract as `paged_prefill_attention_reference` (seq_lens[b] >= q_len_b or 0 is
    assumed, not checked: checking would need a device sync)."""
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    batch = block_tables.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, num_heads, head_dim], dense
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // k_cache.shape[2]
    config = config or default_config(head_dim, group)
    if group % config.q_heads != 0 or config.block_m % config.q_heads != 0:
        raise ValueError(f"q_heads {config.q_heads} must divide the GQA group {group} and block_m {config.block_m}")
    slots = triton.cdiv(num_tokens, config.block_m // config.q_heads) + batch
    head_blocks = num_heads // config.q_heads
    grid = (head_blocks, slots) if config.heads_first else (slots, head_blocks)
    prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *cache_strides(v_cache),
        block_tables.stride(0),
        scale * LOG2E,
        batch,
        num_heads,
        head_dim,
        GROUP=group,
        Q_HEADS=config.q_heads,
        HEAD_DIM_P2=max(triton.next_power_of_2(head_dim), 16),
        BATCH_P2=batch_lanes(batch),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HEADS_FIRST=config.heads_first,
        V_LIKE_K=v_cache.stride() == k_cache.stride(),
        V_PAGE_RUNS=has_page_runs(v_cache),
        IS_FP32=q.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    if q.is_cuda:
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
