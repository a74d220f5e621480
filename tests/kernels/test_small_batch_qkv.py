"""The qkv projection with rotary + KV-cache write in its epilogue: Triton vs torch reference."""

import pytest
import torch
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.small_batch_qkv import can_fuse_rotary, qkv_rope_store_reference, qkv_rope_store_triton

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


def test_which_models_fuse():
    assert can_fuse_rotary(128, 128, is_neox=True, has_qk_norm=False)
    assert not can_fuse_rotary(128, 128, is_neox=True, has_qk_norm=True)  # Qwen3
    assert not can_fuse_rotary(128, 64, is_neox=True, has_qk_norm=False)  # partial rotary
    assert not can_fuse_rotary(128, 128, is_neox=False, has_qk_norm=False)  # GPT-J pairs


def test_rejects_bad_shapes():
    a = torch.randn(2, 8)
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match="weight"):
        qkv_rope_store_triton(a, torch.randn(10, 8), None, None, 0.0, torch.zeros(2, dtype=torch.long),
                              torch.zeros(8, 16), cache, cache, torch.zeros(2, dtype=torch.long), 2, 1)  # fmt: skip
    with pytest.raises(ValueError, match="rows"):
        rows17 = torch.zeros(17, dtype=torch.long)
        qkv_rope_store_triton(torch.randn(17, 8), torch.randn(64, 8), None, None, 0.0, rows17, torch.zeros(8, 16),
                              cache, cache, rows17, 2, 1)  # fmt: skip
