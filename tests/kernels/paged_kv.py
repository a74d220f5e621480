"""Builds random paged KV caches for attention tests: shuffled blocks, spare blocks, garbage past each table, and NaN
in the slots past each sequence's end in its last block (kernels must never let them into a result)."""

from dataclasses import dataclass

import torch

from tidal.kernels.kv_layout import cache_view


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # the same logical shape; tokens innermost when asked (kernels/kv_layout.py)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def in_v_layout(v_cache: torch.Tensor, tokens_innermost: bool) -> torch.Tensor:
    """The same values in a V tensor laid out as asked."""
    if not tokens_innermost:
        return v_cache.contiguous()
    laid_out = cache_view(torch.empty(v_cache.numel(), dtype=v_cache.dtype, device=v_cache.device),
                          tuple(v_cache.shape[1:]), tokens_innermost=True)  # fmt: skip
    laid_out.copy_(v_cache)
    return laid_out


def make_paged_kv(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    v_tokens_innermost: bool = False,
) -> PagedKV:
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max([*blocks_per_seq, 1]) + 1  # one spare column: entries past a sequence must be ignored
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks).tolist()
    # Garbage (far out of range) past each sequence's blocks: reading it would fault or give wrong results.
    tables = torch.full((len(seq_lens), max_blocks), 1 << 30, dtype=torch.int32)
    used = 0
    for b, (count, seq_len) in enumerate(zip(blocks_per_seq, seq_lens, strict=True)):
        tables[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
        if seq_len % block_size:  # the last block's slots past the end: whatever a block's last owner left there
            last = order[used - 1]
            k_cache[last, seq_len % block_size :] = float("nan")
            v_cache[last, seq_len % block_size :] = float("nan")
    return PagedKV(
        k_cache=k_cache,
        v_cache=in_v_layout(v_cache, v_tokens_innermost),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
