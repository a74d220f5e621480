"""How a paged KV cache's V tensor lies in memory; the one place that decides it.

Every cache tensor has the logical shape [num_blocks, block_size, num_kv_heads, head_dim]; K is always stored so
(head dims innermost). V is stored so too, except in an FP8 cache, whose V keeps each block's tokens innermost:
physically [num_blocks, num_kv_heads, head_dim, block_size], handed around as the permuted view with the logical
shape. Why: V is the second operand of P @ V, whose tensor-core tiles want the tokens along the contiguous axis.
With head dims innermost, Triton reads 8-bit V from shared memory one byte at a time (there is no 8-bit transposing
`ldmatrix`); with tokens innermost those byte reads go away, and decode attention from an FP8 cache became 11-20%
faster than from bf16 instead of no faster (benchmarks/results/kv-cache-fp8-v-layout-h200.md). A 16-bit V keeps head
dims innermost: its transposing `ldmatrix` already serves it.

Blocks stay outermost in both layouts, so a block is one contiguous run of bytes: copying blocks (a forked sample's
copy-on-write) and mapping a prefix of them (a wake's first share) work the same for both.

The kernels take V's four strides and need no other knowledge of the layout, except that the attention kernels use
`has_page_runs` to tell the compiler which loads it may vectorise along the tokens.
"""

import math

import torch

from tidal.kernels.kv_cache_dtype import FP8_E4M3

# (block, offset in block, head, dim)
CacheStrides = tuple[int, int, int, int]


def v_tokens_innermost(cache_dtype: torch.dtype) -> bool:
    """Whether a cache of this element type stores V with each block's tokens innermost."""
    return cache_dtype == FP8_E4M3


def cache_view(flat: torch.Tensor, block_shape: tuple[int, int, int], tokens_innermost: bool) -> torch.Tensor:
    """A 1-D tensor of num_blocks * prod(block_shape) elements as a cache tensor of logical shape
    [num_blocks, block_size, num_kv_heads, head_dim]; `block_shape` is (block_size, num_kv_heads, head_dim)."""
    block_size, num_kv_heads, head_dim = block_shape
    num_blocks = flat.numel() // math.prod(block_shape)
    if not tokens_innermost:
        return flat.view(num_blocks, block_size, num_kv_heads, head_dim)
    return flat.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def new_kv_cache_pair(
    num_blocks: int, block_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (K, V) tensors of one layer from torch's allocator, V in the layout its dtype takes."""
    numel = num_blocks * math.prod(block_shape)
    k = cache_view(torch.zeros(numel, dtype=dtype, device=device), block_shape, tokens_innermost=False)
    v = cache_view(torch.zeros(numel, dtype=dtype, device=device), block_shape, v_tokens_innermost(dtype))
    return k, v


def is_tokens_innermost(cache: torch.Tensor) -> bool:
    """Whether a 4-D cache tensor is the tokens-innermost view `cache_view` makes (block_size > 1)."""
    return cache.shape[1] > 1 and cache.permute(0, 2, 3, 1).is_contiguous()


def has_page_runs(v_cache: torch.Tensor) -> bool:
    """Whether V's tokens lie in aligned runs of one page, as a tokens-innermost V with a power-of-two block size
    has: an attention tile that starts on a multiple of its power-of-two width then covers whole runs (or lies in
    one). Other block sizes would put a page boundary inside a run, so the kernels may claim runs only here."""
    block_size = v_cache.shape[1]
    return is_tokens_innermost(v_cache) and block_size & (block_size - 1) == 0


def check_kv_layouts(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K dense [num_blocks, block_size, num_kv_heads, head_dim]; V dense the same way or tokens innermost (either
    layout for any dtype: the kernels follow V's strides)."""
    if not k_cache.is_contiguous():
        raise ValueError(f"k_cache must be contiguous, got strides {k_cache.stride()} for {tuple(k_cache.shape)}")
    if not (v_cache.is_contiguous() or is_tokens_innermost(v_cache)):
        raise ValueError(
            f"v_cache must be contiguous or a tokens-innermost view (kernels/kv_layout.py), got strides "
            f"{v_cache.stride()} for {tuple(v_cache.shape)}"
        )


def cache_strides(cache: torch.Tensor) -> CacheStrides:
    block, offset, head, dim = cache.stride()
    return block, offset, head, dim
