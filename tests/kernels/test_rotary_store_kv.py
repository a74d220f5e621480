"""Rotary embedding fused with the KV-cache write (and Qwen3's per-head q/k norm): Triton kernel vs the composition
of the references."""

import pytest
import torch
from tolerances import assert_close

from tidal.kernels.rms_norm import rms_norm
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm, rotary_store_kv, rotary_store_kv_reference, rotary_store_kv_triton

CASES = [
    # tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox
    (1, 4, 4, 64, 64, True),
    (5, 8, 2, 64, 64, False),  # GPT-J pairs, GQA
    (7, 6, 1, 128, 64, True),  # partial rotary: dims past 64 go to the cache unchanged
    (3, 4, 2, 80, 32, False),  # head_dim not a power of two
]


@pytest.mark.parametrize(("tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "is_neox"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_rotary_then_store(device, tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox, dtype):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))  # strided views of one projection, as in a model
    cache_shape = (6, 4, num_kv_heads, head_dim)  # 6 blocks of 4 slots
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(device)
    slots = torch.randperm(24, generator=gen)[:tokens].to(device)
    slots[0] = -1  # a padding token: rotated q, nothing written
    cos_sin = build_cos_sin_cache(rotary_dim, 128, 10000.0, None, dtype, device)

    results = []
    for fn in (rotary_store_kv_triton, rotary_store_kv_reference):
        q_in = q.clone()
        k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        v_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        out = fn(q_in, k.clone(), v.clone(), positions, cos_sin, is_neox, k_cache, v_cache, slots)
        assert out.data_ptr() == q_in.data_ptr()  # rotated in place
        results.append((out, k_cache, v_cache))
    (q_got, k_got, v_got), (q_want, k_want, v_want) = results
    assert_close(q_got, q_want)
    assert_close(k_got, k_want)
    assert torch.equal(v_got, v_want)
    assert int((k_got != 0).any(dim=(2, 3)).sum()) == tokens - 1  # exactly the non-padding slots were written


def test_dispatch_uses_the_reference_on_cpu():
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    caches = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    cos_sin = build_cos_sin_cache(8, 16, 10000.0, None, torch.float32, "cpu")
    args = (torch.tensor([0, 3]), cos_sin, True, *caches, torch.tensor([1, 2]))
    got = rotary_store_kv(q.clone(), k.clone(), v.clone(), *args)
    want = rotary_store_kv_reference(q.clone(), k.clone(), v.clone(), *args)
    assert torch.equal(got, want)


def test_rejects_a_cache_of_another_dtype():
    cos_sin = build_cos_sin_cache(8, 16, 10000.0, None, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        rotary_store_kv_triton(
            torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([0]), cos_sin, True,
            torch.zeros(2, 2, 1, 8, dtype=torch.float16), torch.zeros(2, 2, 1, 8, dtype=torch.float16),
            torch.tensor([0]),
        )  # fmt: skip


def _head_norms(head_dim: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> tuple[HeadNorm, HeadNorm]:
    """Random gammas far from 1, so a kernel that skips the norm (or applies one norm to both) fails."""
    q_gamma, k_gamma = (torch.rand(head_dim, generator=gen) * 3 + 0.25 for _ in range(2))
    return HeadNorm(q_gamma.to(dtype).to(device), 1e-6), HeadNorm(k_gamma.to(dtype).to(device), 1e-5)


@pytest.mark.parametrize(("tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "is_neox"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_reference_with_the_qk_norm(
    device, tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox, dtype
):
    gen = torch.Generator().manual_seed(tokens + 100)
    # Scaled so the norm matters: unnormalised heads would be far off.
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 5).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    cache_shape = (6, 4, num_kv_heads, head_dim)
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(device)
    slots = torch.randperm(24, generator=gen)[:tokens].to(device)
    slots[0] = -1  # a padding token: normalised and rotated q, nothing written
    cos_sin = build_cos_sin_cache(rotary_dim, 128, 10000.0, None, dtype, device)
    q_norm, k_norm = _head_norms(head_dim, dtype, device, gen)

    results = []
    for fn in (rotary_store_kv_triton, rotary_store_kv_reference):
        qkv_in = qkv.clone()
        q_in, k_in, v_in = (
            x.view(tokens, -1, head_dim)
            for x in qkv_in.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        )  # strided views of one projection, as in a model
        k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        v_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        out = fn(q_in, k_in, v_in, positions, cos_sin, is_neox, k_cache, v_cache, slots, q_norm, k_norm)
        assert out.data_ptr() == q_in.data_ptr()  # normalised and rotated in place
        assert torch.equal(v_in, v)
        results.append((out, k_cache, v_cache))
    (q_got, k_got, v_got), (q_want, k_want, v_want) = results
    # Both round the normalised heads to the dtype before rotating; where their fp32 sums of squares differ in the
    # last bit, that rounding may flip one ulp of a large value, which the rotation carries into a small one.
    assert_close(q_got, q_want, scale=q_want.abs().max().item())
    assert_close(k_got, k_want, scale=k_want.abs().max().item())
    assert torch.equal(v_got, v_want)
    assert int((k_got != 0).any(dim=(2, 3)).sum()) == tokens - 1  # exactly the non-padding slots were written


@pytest.mark.parametrize(("tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "is_neox"), CASES)
def test_the_reference_norm_is_rms_norm_per_head_then_rotary(
    tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox
):
    """The unfused path a Qwen3 layer took before: RMSNorm over each head, then rotary+store; exact in fp32."""
    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen) * 5
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, generator=gen) * 5 for _ in range(2))
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    slots = torch.randperm(24, generator=gen)[:tokens]
    cos_sin = build_cos_sin_cache(rotary_dim, 128, 10000.0, None, torch.float32, "cpu")
    q_norm, k_norm = _head_norms(head_dim, torch.float32, "cpu", gen)
    cache_shape = (6, 4, num_kv_heads, head_dim)

    caches = torch.zeros(cache_shape), torch.zeros(cache_shape)
    got = rotary_store_kv_reference(
        q.clone(), k.clone(), v, positions, cos_sin, is_neox, *caches, slots, q_norm, k_norm
    )
    want_caches = torch.zeros(cache_shape), torch.zeros(cache_shape)
    q_normed, k_normed = (
        rms_norm(x.reshape(-1, head_dim), norm.gamma, norm.eps).view(x.shape)  # type: ignore[union-attr]
        for x, norm in ((q, q_norm), (k, k_norm))
    )
    want = rotary_store_kv_reference(q_normed, k_normed, v, positions, cos_sin, is_neox, *want_caches, slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[0], want_caches[0])
    assert torch.equal(caches[1], want_caches[1])


def test_rejects_a_q_norm_without_a_k_norm():
    cos_sin = build_cos_sin_cache(8, 16, 10000.0, None, torch.float32, "cpu")
    with pytest.raises(ValueError, match="both or neither"):
        rotary_store_kv_reference(
            torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([0]), cos_sin, True,
            torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), torch.tensor([0]), HeadNorm(torch.ones(8), 1e-6),
        )  # fmt: skip
