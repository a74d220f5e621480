"""RMSNorm, SiLU-and-mul, KV cache writes and rotary embedding: Triton kernel vs torch reference."""

import pytest
import torch
from tolerances import assert_close

from tidal.kernels.activation import silu_and_mul, silu_and_mul_reference, silu_and_mul_triton
from tidal.kernels.kv_cache import store_kv, store_kv_reference, store_kv_triton
from tidal.kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_triton
from tidal.kernels.rotary import apply_rotary_reference, apply_rotary_triton, build_cos_sin_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(0, 64), (1, 48), (7, 130), (33, 512)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, tokens, hidden, with_residual):
    x = torch.randn(tokens, hidden + 3, dtype=dtype, device=device)[:, :hidden]  # strided rows
    weight = torch.randn(hidden, dtype=dtype, device=device)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device) if with_residual else None
    got = rms_norm_triton(x, weight, 1e-5, residual)
    want = rms_norm_reference(x, weight, 1e-5, residual)
    if with_residual:
        assert_close(got[0], want[0])
        assert_close(got[1], want[1], scale=0.5)  # one rounding of an fp32 sum (the interpreter truncates bf16)
    else:
        assert_close(got, want)


def test_rms_norm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.randn(3, 8), torch.randn(8), 1e-6, residual=torch.randn(3, 9))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(0, 8), (1, 1), (5, 37), (17, 1500)])
def test_silu_and_mul_matches_reference(device, dtype, tokens, inter):
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device) * 3
    assert_close(silu_and_mul_triton(x, block=256), silu_and_mul_reference(x))


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (3, 80, 1), (8, 128, 5), (2, 256, 32)]
)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(device, dtype, num_kv_heads, head_dim, block_size, slot_dtype):
    num_blocks, tokens = 12, 11
    qkv = torch.randn(tokens, 4 * num_kv_heads, head_dim, dtype=dtype, device=device)  # k, v are strided views
    k, v = qkv[:, :num_kv_heads], qkv[:, 2 * num_kv_heads : 3 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens].to(slot_dtype)
    slots[[2, 7]] = -1  # padding tokens
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    got_k, got_v = caches[0].clone(), caches[1].clone()
    store_kv_triton(k, v, got_k, got_v, slots)
    store_kv_reference(k, v, caches[0], caches[1], slots)
    assert torch.equal(got_k, caches[0])
    assert torch.equal(got_v, caches[1])


def test_store_kv_skips_everything_for_empty_and_padding(device):
    cache = torch.randn(2, 4, 1, 8, device=device)
    before = cache.clone()
    empty = torch.randn(0, 1, 8, device=device)
    store_kv(empty, empty, cache, cache, torch.zeros(0, dtype=torch.int64, device=device))
    k = torch.randn(2, 1, 8, device=device)
    store_kv_triton(k, k, cache, cache, torch.full((2,), -1, dtype=torch.int32, device=device))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"), [(4, 2, 64, 64), (3, 1, 80, 32), (8, 8, 128, 128)]
)
def test_rotary_matches_reference(device, dtype, is_neox, num_heads, num_kv_heads, head_dim, rotary_dim):
    tokens, max_position = 9, 300
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    cache = build_cos_sin_cache(rotary_dim, max_position, 10000.0, scaling, dtype, device)
    q = torch.randn(tokens, num_heads, head_dim + 8, dtype=dtype, device=device)[..., :head_dim]  # strided heads
    k = torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, max_position, (tokens,), device=device)
    q_want, k_want = apply_rotary_reference(q.clone(), k.clone(), positions, cache, is_neox)
    q_got, k_got = apply_rotary_triton(q, k, positions, cache, is_neox)
    assert q_got.data_ptr() == q.data_ptr()  # in place
    assert_close(q_got, q_want)
    assert_close(k_got, k_want)
