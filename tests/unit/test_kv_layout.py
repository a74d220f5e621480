"""The V cache's two layouts (kernels/kv_layout.py): which dtype takes which, the views, and the refusals."""

import pytest
import torch

from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.kv_layout import (
    cache_view,
    check_kv_layouts,
    has_page_runs,
    is_tokens_innermost,
    new_kv_cache_pair,
    v_tokens_innermost,
)

CPU = torch.device("cpu")


def test_only_an_fp8_cache_keeps_v_tokens_innermost():
    assert v_tokens_innermost(FP8_E4M3)
    assert not any(v_tokens_innermost(d) for d in (torch.bfloat16, torch.float16, torch.float32))
    k, v = new_kv_cache_pair(3, (16, 2, 8), FP8_E4M3, CPU)
    assert k.is_contiguous() and is_tokens_innermost(v) and has_page_runs(v)
    assert k.shape == v.shape == (3, 16, 2, 8) and not v.float().any()
    k, v = new_kv_cache_pair(3, (16, 2, 8), torch.bfloat16, CPU)
    assert v.is_contiguous() and not is_tokens_innermost(v)


def test_a_tokens_innermost_view_puts_a_pages_tokens_side_by_side():
    flat = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32)
    v = cache_view(flat, (4, 3, 5), tokens_innermost=True)  # 2 blocks of 4 tokens, 3 heads, head_dim 5
    assert v.shape == (2, 4, 3, 5)
    assert v[1, :, 2, 3].tolist() == [flat[60 + (2 * 5 + 3) * 4 + t].item() for t in range(4)]
    assert v[1, 2, 1, 4] == flat[60 + (1 * 5 + 4) * 4 + 2]


def test_odd_block_sizes_have_no_page_runs_to_claim():
    _, v = new_kv_cache_pair(3, (5, 2, 8), FP8_E4M3, CPU)
    assert is_tokens_innermost(v) and not has_page_runs(v)
    _, v1 = new_kv_cache_pair(3, (1, 2, 8), FP8_E4M3, CPU)  # one token a block: the two layouts are one
    assert v1.is_contiguous() and not is_tokens_innermost(v1)


def test_other_layouts_are_refused_by_the_writers():
    k, v = new_kv_cache_pair(3, (16, 2, 8), FP8_E4M3, CPU)
    check_kv_layouts(k, v)
    with pytest.raises(ValueError, match="v_cache must be contiguous or a tokens-innermost view"):
        check_kv_layouts(k, v.transpose(1, 2).contiguous().transpose(1, 2))  # head-major blocks
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        check_kv_layouts(v, v)
