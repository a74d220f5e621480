"""Builds random paged KV caches for attention tests: shuffled blocks, spare blocks, and garbage past each table."""

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def make_paged_kv(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
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
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    return PagedKV(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
