"""Causal prefill/extend attention over the paged cache: Triton vs the torch reference."""

import pytest
import torch
from paged_kv import make_paged_kv
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels.prefill_attention import (
    PrefillConfig,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)

CASES = [
    # (q_len, cached prefix) per sequence, block_size, num_heads, num_kv_heads, head_dim
    ([(5, 0)], 16, 2, 2, 64),
    ([(1, 0), (0, 7), (19, 0), (3, 30)], 4, 4, 2, 64),  # length-1, no new tokens, prefix + extend
    ([(40, 9), (17, 0)], 16, 6, 1, 128),  # MQA with group 6, tiles crossing the diagonal
    ([(23, 5)], 32, 4, 2, 256),
    ([(13, 2), (6, 0)], 5, 3, 3, 80),  # odd block size and head dim
]


@pytest.mark.parametrize(("lens", "block_size", "num_heads", "num_kv_heads", "head_dim"), CASES)
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("v_tokens_innermost", [False, True])
def test_prefill_matches_reference(device, lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                   v_tokens_innermost):  # fmt: skip
    """V in either layout (kernels/kv_layout.py)."""
    q_lens = [n for n, _ in lens]
    seq_lens = [n + prefix for n, prefix in lens]
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, v_tokens_innermost)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, head_dim**-0.5)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert_close(paged_prefill_attention_triton(*args, config=config), paged_prefill_attention_reference(*args))


@pytest.mark.parametrize("q_heads", [2, 4])
@pytest.mark.parametrize("heads_first", [False, True])
def test_prefill_packed_heads_and_grid_order(device, q_heads, heads_first):
    """Tiles holding several query heads of one KV group, and the heads-first launch order."""
    q_lens, prefixes = [21, 1, 0, 9], [5, 0, 4, 30]
    seq_lens = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kv = make_paged_kv(seq_lens, 8, 2, 64, torch.float32, device)
    q = torch.randn(sum(q_lens), 8, 64, device=device)  # group 4
    cu = torch.tensor([0, 21, 22, 22, 31], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, q_heads=q_heads, heads_first=heads_first)
    assert_close(paged_prefill_attention_triton(*args, config=config), paged_prefill_attention_reference(*args))


@pytest.mark.parametrize("pad", [1, 7, 40, 100])
@pytest.mark.parametrize("block_m", [16, 64])  # 8 or 32 tokens a tile, against 16 keys: both orders of the two
def test_a_sequence_without_context_comes_out_zero(device, pad, block_m):
    """A captured step's padding (prefill_graphs.py): its extra tokens form a sequence with seq_len 0, followed by
    empty ones up to the graph's batch; their rows are zero and the real sequences' rows are as without them."""
    q_lens, prefixes = [9, 1, 21], [3, 12, 0]
    seq_lens = [n + p for n, p in zip(q_lens, prefixes, strict=True)] + [0, 0, 0]
    kv = make_paged_kv(seq_lens, 8, 2, 64, torch.float32, device)
    real = sum(q_lens)
    q = torch.randn(real + pad, 4, 64, device=device)
    cu = torch.tensor([0, 9, 10, 31, 31 + pad, 31 + pad, 31 + pad], dtype=torch.int32, device=device)
    config = PrefillConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1, q_heads=2)
    padded = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    got = paged_prefill_attention_triton(*padded, config=config)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(paged_prefill_attention_reference(*padded)[real:], torch.zeros_like(got[real:]))
    alone = (q[:real], kv.k_cache, kv.v_cache, kv.block_tables[:3], cu[:4], kv.seq_lens[:3], 0.125)
    assert_close(got[:real], paged_prefill_attention_reference(*alone))


def test_prefill_rejects_packing_across_kv_groups():
    kv = make_paged_kv([4], 4, 2, 16, torch.float32, "cpu")
    args = (torch.randn(4, 4, 16), kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="q_heads"):
        paged_prefill_attention_triton(*args, kv.seq_lens, 1.0, config=PrefillConfig(16, 16, 4, 1, q_heads=4))


def test_prefill_without_prefix_equals_dense_causal_attention():
    kv = make_paged_kv([9], 4, 2, 16, torch.float32, "cpu")
    k = kv.k_cache[kv.block_tables[0, :3].long()].reshape(-1, 2, 16)[:9]  # [9, 2, 16]
    v = kv.v_cache[kv.block_tables[0, :3].long()].reshape(-1, 2, 16)[:9]
    q = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    got = paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.25)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.25
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_cu_seqlens():
    kv = make_paged_kv([4, 4], 4, 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(
            torch.randn(8, 1, 16), kv.k_cache, kv.v_cache, kv.block_tables,
            torch.tensor([0, 8], dtype=torch.int32), kv.seq_lens, 1.0,
        )  # fmt: skip


def test_prefill_default_tiles(device):
    """The tile shapes used on the GPU, on a batch mixing a long extend with short prompts."""
    q_lens, prefixes = [70, 1, 3], [140, 0, 9]
    seq_lens = [n + p for n, p in zip(q_lens, prefixes, strict=True)]
    kv = make_paged_kv(seq_lens, 16, 2, 128, torch.float16, device)
    q = torch.randn(sum(q_lens), 4, 128, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 70, 71, 74], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 128**-0.5)
    assert_close(paged_prefill_attention_triton(*args), paged_prefill_attention_reference(*args))
