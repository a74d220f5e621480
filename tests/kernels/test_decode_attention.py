"""Paged decode attention: Triton (single pass and split-K) vs the torch reference."""

import pytest
import torch
from paged_kv import make_paged_kv
from tolerances import DOT_DTYPES, assert_close

import tidal.kernels._decode_attention_kernels as decode_kernels
from tidal.kernels._split_k import arrival_counters
from tidal.kernels.decode_attention import (
    MANY_PROGRAMS_TILE,
    choose_num_splits,
    choose_tile,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
    reads_first_tile_early,
)

CASES = [
    # seq_lens, block_size, num_heads, num_kv_heads, head_dim
    ([1], 16, 4, 4, 64),
    ([0, 5, 1, 40], 16, 8, 2, 64),  # empty and length-1 sequences, GQA 4
    ([37, 3, 70], 8, 6, 1, 128),  # MQA, group 6 (not a power of two)
    ([65, 17], 32, 4, 2, 256),
    ([9, 33, 1], 5, 3, 3, 80),  # odd block size and head dim
]


@pytest.mark.parametrize(("seq_lens", "block_size", "num_heads", "num_kv_heads", "head_dim"), CASES)
@pytest.mark.parametrize("num_splits", [1, 3, 6])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("v_tokens_innermost", [False, True])
@pytest.mark.parametrize("early_first_tile", [False, True])
def test_decode_matches_reference(device, seq_lens, block_size, num_heads, num_kv_heads, head_dim, num_splits,
                                  dtype, v_tokens_innermost, early_first_tile):  # fmt: skip
    """Unsplit, and split with the merge by the last split (6: more splits than one merge chunk); V in either
    layout (kernels/kv_layout.py), the odd block size's without the runs a power of two gives; each split's first
    tile read in the loop or before the wait, the newest token then on its own."""
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, v_tokens_innermost)
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    got = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=16, early_first_tile=early_first_tile)
    assert_close(got, paged_decode_attention_reference(*args))
    assert torch.all(got[torch.tensor(seq_lens) == 0] == 0)


@pytest.mark.parametrize("v_tokens_innermost", [False, True])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("block_n", [None, MANY_PROGRAMS_TILE[0]])
@pytest.mark.parametrize("early_first_tile", [False, True])
def test_the_engines_tile_width_with_long_partial_tails(device, v_tokens_innermost, block_size, num_splits, block_n,
                                                        early_first_tile):  # fmt: skip
    """The tile widths the engine launches (64 tokens at head_dim 128, 32 over many programs): whole tiles unmasked,
    then tails of up to 63 tokens 16 at a time, with pages smaller than, equal to and larger than those 16; the
    first tile read before the wait or not."""
    seq_lens = [64 + 40, 128 + 17, 63, 64, 1, 200]
    kv = make_paged_kv(seq_lens, block_size, 2, 128, torch.float32, device, v_tokens_innermost)
    q = torch.randn(len(seq_lens), 4, 128, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 128**-0.5)
    got = paged_decode_attention_triton(
        *args, num_splits=num_splits, block_n=block_n, early_first_tile=early_first_tile
    )
    assert_close(got, paged_decode_attention_reference(*args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="swaps the wait of the interpreted kernel")
@pytest.mark.parametrize("v_tokens_innermost", [False, True])
@pytest.mark.parametrize(
    ("seq_len", "num_splits"),
    [(1, 1), (9, 1), (16, 1), (17, 1), (47, 1), (48, 1), (9, 3)],  # the newest first, inside, last of a tile, later
)
def test_the_step_s_own_token_is_read_after_the_wait(monkeypatch, v_tokens_innermost, seq_len, num_splits):
    """With the first tile read before the wait, the token the previous kernel stores (position seq_len - 1) must
    be read only after it. Here the wait is where that store lands: until then the slot holds NaN, which any read
    of it before would carry into the output. One sequence and KV head, so the only split with tokens runs first
    (the interpreter runs programs one by one, and a later program's early reads would see the store)."""
    kv = make_paged_kv([seq_len], 16, 1, 64, torch.float32, "cpu", v_tokens_innermost)
    q = torch.randn(1, 4, 64)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = paged_decode_attention_reference(*args)
    page, slot = int(kv.block_tables[0, (seq_len - 1) // 16]), (seq_len - 1) % 16
    stored = kv.k_cache[page, slot].clone(), kv.v_cache[page, slot].clone()
    kv.k_cache[page, slot], kv.v_cache[page, slot] = float("nan"), float("nan")

    def the_previous_kernel_finishes(use_pdl):
        kv.k_cache[page, slot], kv.v_cache[page, slot] = stored

    monkeypatch.setattr(decode_kernels, "wait_for_previous_kernel", the_previous_kernel_finishes)
    got = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=16, early_first_tile=True)
    assert_close(got, expected)


def test_the_first_tile_is_read_early_only_in_launches_of_few_programs():
    assert reads_first_tile_early(programs=4, num_splits=16, num_sms=132)  # Qwen3-30B-A3B at one sequence
    assert reads_first_tile_early(programs=8, num_splits=16, num_sms=132)  # the 8B at one sequence
    assert not reads_first_tile_early(programs=8 * 4, num_splits=13, num_sms=132)  # 416 programs: ~3 a multiprocessor
    assert not reads_first_tile_early(programs=256 * 4, num_splits=1, num_sms=132)
    # TIDAL_DECODE_EARLY_TILE=0 turns it off (for A/B timing).
    assert not reads_first_tile_early(programs=4, num_splits=16, num_sms=132, switched_on=False)


def test_tiles_narrower_than_16_tokens_are_refused():
    kv = make_paged_kv([6], 4, 1, 16, torch.float32, "cpu")
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        paged_decode_attention_triton(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25, block_n=8)


def test_decode_fp16_strided_query(device):
    kv = make_paged_kv([20, 7], 4, 2, 64, torch.float16, device)
    q = torch.randn(2, 12, 64, dtype=torch.float16, device=device)[:, ::3]  # [2, 4, 64], head stride 192
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    assert_close(
        paged_decode_attention_triton(*args, num_splits=2, block_n=16), paged_decode_attention_reference(*args)
    )


def test_dispatch_uses_reference_on_cpu():
    kv = make_paged_kv([6], 4, 1, 16, torch.float32, "cpu")
    q = torch.randn(1, 2, 16)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25)
    assert torch.equal(paged_decode_attention(*args), paged_decode_attention_reference(*args))


def test_rejects_bad_group_and_dtypes():
    kv = make_paged_kv([6], 4, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn(1, 3, 16), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(torch.randn(1, 2, 16), kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens, 1.0)


def test_split_choice_fills_the_device_and_respects_short_contexts():
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=32768, num_sms=132) > 8
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=128, num_sms=132) == 1
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context=4096, num_sms=132) == 1


def test_the_small_tile_only_where_many_unsplit_programs_read_a_tokens_innermost_v():
    many = 256 * 8  # batch 256 x 8 KV heads: ~15.5 programs a multiprocessor on 132
    assert choose_tile(many, 1, 128, tokens_inner=True, num_sms=132) == MANY_PROGRAMS_TILE
    assert choose_tile(64 * 8, 1, 128, tokens_inner=True, num_sms=132) == (64, 4, 2)  # ~3.9 a multiprocessor
    assert choose_tile(many, 2, 128, tokens_inner=True, num_sms=132) == (64, 4, 2)  # split: its own tuning
    assert choose_tile(many, 1, 128, tokens_inner=False, num_sms=132) == (64, 4, 3)  # dims-innermost (bf16) V
    assert choose_tile(many, 1, 256, tokens_inner=True, num_sms=132) == (32, 4, 2)  # wide heads keep 4 warps


def test_v_cache_is_read_by_its_own_strides(device):
    """The kernel follows V's strides, whatever they are, so long as each head's dims or each page's tokens are
    dense; V with neither is refused."""
    kv = make_paged_kv([20, 7], 4, 2, 64, torch.float32, device)
    head_major = kv.v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, head-major blocks
    q = torch.randn(2, 4, 64, device=device)
    args = (q, kv.k_cache, head_major, kv.block_tables, kv.seq_lens, 0.125)
    assert_close(paged_decode_attention_triton(*args, block_n=16), paged_decode_attention_reference(*args))
    scattered = kv.v_cache.transpose(0, 3).contiguous().transpose(0, 3)  # neither dims nor tokens dense
    with pytest.raises(ValueError, match="stride 1 in its last dimension"):
        paged_decode_attention_triton(q, kv.k_cache, scattered, kv.block_tables, kv.seq_lens, 0.125)


@pytest.mark.parametrize("num_splits", [4, 16])
def test_short_contexts_in_a_wide_table_split_by_their_own_length(device, num_splits):
    # A CUDA graph passes its full-width table (max_model_len) whatever the contexts are: each sequence's splits must
    # cover exactly its own context, most of them empty when it is short.
    kv = make_paged_kv([3, 40, 0, 130, 1], 16, 2, 64, torch.float32, device)
    tables = torch.zeros(5, 64, dtype=kv.block_tables.dtype, device=device)
    tables[:, : kv.block_tables.shape[1]] = kv.block_tables
    q = torch.randn(5, 4, 64, device=device)
    args = (q, kv.k_cache, kv.v_cache, tables, kv.seq_lens, 0.125)
    got = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=16)
    assert_close(got, paged_decode_attention_reference(*args))
    assert not arrival_counters(torch.device(device), 1).any()  # every launch leaves the counters at zero


def test_in_kernel_merge_is_bitwise_repeatable(device):
    """Which split finishes last varies between runs on a GPU; the merge's order does not."""
    kv = make_paged_kv([300, 77], 16, 2, 64, torch.float32, device)
    q = torch.randn(2, 8, 64, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    first = paged_decode_attention_triton(*args, num_splits=8, block_n=16)
    for _ in range(50 if device == "cuda" else 2):
        assert torch.equal(paged_decode_attention_triton(*args, num_splits=8, block_n=16), first)
