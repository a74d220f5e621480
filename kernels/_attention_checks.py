"""Shape/dtype checks shared by the paged attention wrappers (decode and prefill)."""

import torch

from tidal.kernels._validate import (
    FLOAT_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_shape,
)
from tidal.kernels.kv_cache_dtype import check_cache_dtype
from tidal.kernels.kv_layout import is_tokens_innermost


def check_paged_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """q [*, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim] (V in either layout of
    kernels/kv_layout.py); tables [B, max_blocks]."""
    check_ndim("q", q, 3)
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("k_cache", k_cache, 4)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_cache_dtype("k_cache and v_cache", q.dtype, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_ndim("block_tables", block_tables, 2)
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_same_device("q, k_cache, v_cache and block_tables", q, k_cache, v_cache, block_tables)
    for name, t in (("q", q), ("k_cache", k_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    if not is_tokens_innermost(v_cache):  # the kernels follow V's strides: dense head dims or dense page tokens
        check_last_dim_contiguous("v_cache", v_cache)


def check_seq_lens(seq_lens: torch.Tensor, batch: int, device: torch.device) -> None:
    check_shape("seq_lens", seq_lens, (batch,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    if seq_lens.device != device:
        raise ValueError(f"seq_lens must be on {device}, got {seq_lens.device}")


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:  # -> [seq_len, num_kv_heads, head_dim]
    """The first seq_len cached rows of one sequence, in order."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, num_kv_heads, head_dim]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
