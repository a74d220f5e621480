"""Attention over the paged KV cache: store the step's new K/V, then attend (tidal.kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.kernels.decode_attention import paged_decode_attention
from tidal.kernels.kv_cache import store_kv
from tidal.kernels.prefill_attention import paged_prefill_attention


@dataclass
class AttentionBatch:
    """The device-side form of a step plan's attention fields plus the cache they index."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = don't write
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    is_decode_only: bool  # every sequence has exactly one new token
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [num_blocks, block_size, kv_heads, hd]


class PagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def kv_cache(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return batch.kv_caches[self.layer_idx]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        k_cache, v_cache = self.kv_cache(batch)
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        return self.attend(q, batch)

    def attend(self, q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attention of q [T, num_heads, head_dim] over the cache, whose new K/V rows are already written."""
        k_cache, v_cache = self.kv_cache(batch)
        if batch.is_decode_only:
            return paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, self.scale)
        # Mixed steps (prefill chunks and decodes together) take the prefill path: a decode is a chunk of one.
        return paged_prefill_attention(
            q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, self.scale
        )
