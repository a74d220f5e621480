"""The qkv projection with rotary + KV-cache write in its epilogue: Triton vs torch reference."""

import pytest
import torch
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels._split_k import arrival_counters
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_qkv import (
    can_fuse_rotary,
    default_split_k,
    qkv_rope_store_reference,
    qkv_rope_store_triton,
)

NUM_BLOCKS, BLOCK_SIZE = 6, 4


def _case(rows, num_q_heads, num_kv_heads, head_dim, k_in, dtype, device, bias, normed):
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    a = torch.randn(rows, k_in, dtype=dtype, device=device)
    weight = torch.randn(n, k_in, dtype=dtype, device=device) / k_in**0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    partials = (torch.rand(3, rows, device=device) + 0.5) * k_in / 3 if normed else None
    positions = torch.randint(0, 100, (rows,), device=device)
    cos_sin = build_cos_sin_cache(head_dim, 128, 10000.0, None, dtype, device)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:rows]
    if rows > 1:
        slots[1] = -1  # a padding row: nothing written for it
    return a, weight, b, partials, positions, cos_sin, slots


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("rows", "num_q_heads", "num_kv_heads", "head_dim"), [(1, 4, 2, 16), (3, 2, 1, 64), (5, 4, 4, 80), (16, 6, 2, 32)]
)
@pytest.mark.parametrize(("bias", "normed"), [(False, False), (True, True)])
def test_matches_reference(device, dtype, rows, num_q_heads, num_kv_heads, head_dim, bias, normed):
    a, weight, b, partials, positions, cos_sin, slots = _case(
        rows, num_q_heads, num_kv_heads, head_dim, 48, dtype, device, bias, normed
    )
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got_q = qkv_rope_store_triton(a, weight, b, partials, 1e-6, positions, cos_sin, got_k, got_v, slots,
                                  num_q_heads, num_kv_heads, block_k=16)  # fmt: skip
    want_q = qkv_rope_store_reference(a, weight, b, partials, 1e-6, positions, cos_sin, caches[0], caches[1], slots,
                                      num_q_heads, num_kv_heads)  # fmt: skip
    assert_close(got_q, want_q, scale=3)
    assert_close(got_k, caches[0], scale=3)
    assert_close(got_v, caches[1], scale=3)


def test_padding_rows_and_unused_slots_stay_untouched(device):
    a, weight, _, _, positions, cos_sin, _ = _case(2, 2, 1, 16, 32, torch.float16, device, False, False)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, 16, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1], device=device)
    qkv_rope_store_triton(a, weight, None, None, 0.0, positions, cos_sin, k_cache, v_cache, slots, 2, 1)
    written = (k_cache.flatten(0, 1).abs().sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    assert written == [5]
    assert (v_cache.flatten(0, 1).abs().sum(dim=(1, 2)) > 0).nonzero().flatten().tolist() == [5]


def _head_norms(head_dim, dtype, device):
    """Qwen3-like q and k norms: weights around 1, different per dim and between q and k."""
    return tuple(HeadNorm(torch.rand(head_dim, device=device).to(dtype) + 0.5, eps) for eps in (1e-6, 1e-5))


def _caches(num_kv_heads, head_dim, dtype, device):
    return [torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "num_q_heads", "num_kv_heads", "head_dim"), [(1, 4, 2, 32), (5, 2, 1, 64),
                                                                                 (16, 6, 2, 32)])  # fmt: skip
# K 48 in steps of 16: split 2 takes 2 + 1 steps, 3 one each, 4 leaves the last split no K at all.
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
@pytest.mark.parametrize(("bias", "normed"), [(False, False), (True, True)])
def test_qk_norm_matches_reference(device, dtype, rows, num_q_heads, num_kv_heads, head_dim, split_k, bias, normed):
    a, weight, b, partials, positions, cos_sin, slots = _case(
        rows, num_q_heads, num_kv_heads, head_dim, 48, dtype, device, bias, normed
    )
    q_norm, k_norm = _head_norms(head_dim, dtype, device)
    caches = _caches(num_kv_heads, head_dim, dtype, device)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got_q = qkv_rope_store_triton(a, weight, b, partials, 1e-6, positions, cos_sin, got_k, got_v, slots, num_q_heads,
                                  num_kv_heads, q_norm, k_norm, split_k=split_k, block_k=16)  # fmt: skip
    unwritten = [s for s in range(NUM_BLOCKS * BLOCK_SIZE) if s not in slots.tolist()]  # incl. the slot -1 row's
    for got, before in ((got_k, caches[0]), (got_v, caches[1])):
        assert torch.equal(got.flatten(0, 1)[unwritten], before.flatten(0, 1)[unwritten])
    want_q = qkv_rope_store_reference(a, weight, b, partials, 1e-6, positions, cos_sin, caches[0], caches[1], slots,
                                      num_q_heads, num_kv_heads, q_norm, k_norm)  # fmt: skip
    assert_close(got_q, want_q, scale=3)
    assert_close(got_k, caches[0], scale=3)
    assert_close(got_v, caches[1], scale=3)
    assert not arrival_counters(a.device, 1).any()  # every launch leaves them at zero for the next


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_split_k_changes_only_the_order_of_the_fp32_sums(device, dtype):
    a, weight, b, partials, positions, cos_sin, slots = _case(7, 4, 2, 32, 96, dtype, device, True, True)
    norms = _head_norms(32, dtype, device)
    caches = _caches(2, 32, dtype, device)
    results = []
    for split_k in (1, 3):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        q = qkv_rope_store_triton(a, weight, b, partials, 1e-6, positions, cos_sin, k_cache, v_cache, slots, 4, 2,
                                  *norms, split_k=split_k, block_k=16)  # fmt: skip
        results.append((q, k_cache, v_cache))
    for got, want in zip(results[1], results[0], strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # a sum a few fp32 ulps off may round to the neighbouring 16-bit value
            assert_close(got, want)


def test_splits_k_without_the_norm_too(device):
    a, weight, b, partials, positions, cos_sin, slots = _case(3, 2, 1, 64, 48, torch.float32, device, True, True)
    caches = _caches(1, 64, torch.float32, device)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got_q = qkv_rope_store_triton(a, weight, b, partials, 1e-6, positions, cos_sin, got_k, got_v, slots, 2, 1,
                                  split_k=3, block_k=16)  # fmt: skip
    want_q = qkv_rope_store_reference(a, weight, b, partials, 1e-6, positions, cos_sin, caches[0], caches[1], slots,
                                      2, 1)  # fmt: skip
    assert_close(got_q, want_q)
    assert_close(got_k, caches[0])
    assert_close(got_v, caches[1])


def test_default_split_k():
    assert default_split_k(40, 16, whole_heads=True) == 2  # Qwen3-30B-A3B: 32 + 4 + 4 heads -> 80 programs
    assert default_split_k(6, 100, whole_heads=True) == 14
    assert default_split_k(6, 4, whole_heads=True) == 4  # no more splits than K has steps
    assert default_split_k(80, 16, whole_heads=True) == 1  # Qwen3-32B: 64 + 8 + 8 heads, enough programs already
    assert default_split_k(40, 16, whole_heads=False) == 1  # half-head tiles: as measured, unsplit


def test_which_models_fuse():
    assert can_fuse_rotary(128, 128, is_neox=True, has_qk_norm=False)
    assert can_fuse_rotary(128, 128, is_neox=True, has_qk_norm=True)  # Qwen3: a whole head per program
    assert can_fuse_rotary(32, 32, is_neox=True, has_qk_norm=True)
    assert not can_fuse_rotary(80, 80, is_neox=True, has_qk_norm=True)  # a half of 40 is no tile
    assert not can_fuse_rotary(512, 512, is_neox=True, has_qk_norm=True)  # too wide for one program
    assert not can_fuse_rotary(128, 64, is_neox=True, has_qk_norm=False)  # partial rotary
    assert not can_fuse_rotary(128, 128, is_neox=False, has_qk_norm=False)  # GPT-J pairs


def test_rejects_bad_shapes():
    a = torch.randn(2, 8)
    cache = torch.zeros(2, 4, 1, 16)
    idx = torch.zeros(2, dtype=torch.long)
    norm = HeadNorm(torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="head_dim"):  # a half of 8 is narrower than a tile
        qkv_rope_store_triton(a, torch.randn(64, 8), None, None, 0.0, idx, torch.zeros(8, 16), cache, cache, idx, 2,
                              1, norm, norm)  # fmt: skip
    with pytest.raises(ValueError, match="together"):
        qkv_rope_store_triton(a, torch.randn(64, 8), None, None, 0.0, idx, torch.zeros(8, 16), cache, cache, idx, 2,
                              1, norm, None)  # fmt: skip
    with pytest.raises(ValueError, match="weight"):
        qkv_rope_store_triton(a, torch.randn(10, 8), None, None, 0.0, torch.zeros(2, dtype=torch.long),
                              torch.zeros(8, 16), cache, cache, torch.zeros(2, dtype=torch.long), 2, 1)  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        rows17 = torch.zeros(17, dtype=torch.long)
        qkv_rope_store_triton(torch.randn(17, 8), torch.randn(64, 8), None, None, 0.0, rows17, torch.zeros(8, 16),
                              cache, cache, rows17, 2, 1)  # fmt: skip


def test_rejects_bad_tile_widths():
    """block_n: a power of two from 16 to the half-head's next power of two; whole heads (a q/k norm) only the half."""
    heads, kv_heads, head_dim = 2, 1, 64  # halves of 32
    a, idx = torch.randn(2, 8), torch.zeros(2, dtype=torch.long)
    weight, cos_sin = torch.randn((heads + 2 * kv_heads) * head_dim, 8), torch.zeros(8, head_dim)
    cache = torch.zeros(2, 4, kv_heads, head_dim)
    norm = HeadNorm(torch.ones(head_dim), 1e-6)
    for block_n in (8, 24, 64):
        with pytest.raises(ValueError, match="block_n must be a power of two"):
            qkv_rope_store_triton(a, weight, None, None, 0.0, idx, cos_sin, cache, cache, idx, heads, kv_heads,
                                  block_n=block_n)  # fmt: skip
    with pytest.raises(ValueError, match="whole heads"):
        qkv_rope_store_triton(a, weight, None, None, 0.0, idx, cos_sin, cache, cache, idx, heads, kv_heads, norm,
                              norm, block_n=16)  # fmt: skip
