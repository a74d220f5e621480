"""FP8 linear layers: the row quantization kernel against its reference (bit for bit), the FP8 GEMM against the
reference, and the small-batch kernels over e4m3 weights against theirs."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels import small_batch_linear
from tidal.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tidal.kernels.fp8_linear import (
    MIN_SCALE,
    QuantizedRows,
    can_quantize,
    fp8_linear,
    fp8_linear_reference,
    quantize_rows_into_,
    quantize_rows_reference,
    quantize_rows_triton,
    quantized_rows_reference,
    uses_fp8_gemm,
)
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.small_batch_linear import (
    LaunchConfig,
    choose_config,
    linear_rows_into_residual_reference,
    linear_rows_into_residual_triton,
    linear_rows_reference,
    linear_rows_triton,
)
from tidal.kernels.small_batch_qkv import qkv_rope_store_reference, qkv_rope_store_triton

SMALL = LaunchConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _fp8_weight(n_out, k_in, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, k_in, generator=gen) / k_in**0.5
    w[0] *= 8  # rows of very different ranges: each gets its own scale
    q, scale = quantize_rows_reference(w)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "k_in"), [(1, 16), (5, 100), (3, 2500)])  # 2500: several K blocks, ragged
def test_quantize_rows_kernel_gives_the_reference_bits(device, dtype, rows, k_in):
    x = torch.randn(rows, k_in + 3, device=device).mul(torch.logspace(-3, 3, rows, device=device)[:, None])
    x = x.to(dtype)[:, :k_in]  # strided rows, magnitudes from 1e-3 to 1e3
    if rows > 2:
        x[1] = 0  # a row of zeros: the smallest scale, zeros out
    q, scale = quantize_rows_triton(x)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if rows > 2:
        assert scale[1].item() == MIN_SCALE and not q[1].float().any()


def test_quantized_rows_are_close_and_saturate_at_their_max():
    x = torch.randn(4, 300) * torch.tensor([1e-4, 1.0, 30.0, 5e3])[:, None]
    q, scale = quantize_rows_reference(x)
    assert q.dtype == FP8_E4M3 and scale.dtype == torch.float32
    back = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself; the largest maps to 448 exactly.
    assert ((back - x).abs() <= x.abs() / 16 + scale[:, None] * 2**-9).all()
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((4,), 448.0))


def test_quantize_rows_into_writes_views_of_live_weights():
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    live_q = torch.zeros(16, 32, dtype=FP8_E4M3)
    live_scale = torch.zeros(16)
    quantize_rows_into_(w, live_q[4:12], live_scale[4:12])
    q, scale = quantize_rows_reference(w)
    assert torch.equal(live_q[4:12].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(live_scale[4:12], scale) and not live_scale[:4].any() and not live_scale[12:].any()
    with pytest.raises(ValueError, match="q_out"):
        quantize_rows_into_(w, live_q[:4], live_scale[:4])


def test_fp8_linear_reference_is_the_dequantized_product():
    x = torch.randn(20, 64)
    w8, ws = _fp8_weight(48, 64, "cpu")
    bias = torch.randn(48)
    qx, sx = quantize_rows_reference(x)
    want = (qx.float() * sx[:, None]) @ (w8.float() * ws[:, None]).T + bias
    torch.testing.assert_close(fp8_linear_reference(x, w8, ws, bias), want, atol=1e-5, rtol=1e-5)
    # And near the unquantized product: both operands within 1/16 of themselves.
    dense = F.linear(x, w8.float() * ws[:, None], bias)
    assert (fp8_linear_reference(x, w8, ws, bias) - dense).abs().max() < 0.15 * dense.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 GEMM needs a GPU")
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_fp8_gemm_matches_the_reference(rows):
    if not uses_fp8_gemm(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("the FP8 GEMM needs compute capability 8.9+")
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    w8, ws = _fp8_weight(384, 256, "cuda")
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    got = fp8_linear(x, w8, ws, bias)
    assert got.dtype == torch.bfloat16
    assert_close(got, fp8_linear_reference(x, w8, ws, bias), scale=2)  # the same products, summed in another order


def test_which_shapes_quantize():
    assert can_quantize(4096, 14336) and can_quantize(16, 16)
    assert not can_quantize(1, 2048) and not can_quantize(48, 40)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "n_out", "k_in"), [(1, 48, 80), (5, 32, 64), (16, 64, 96)])
@pytest.mark.parametrize(("normed", "gated"), [(False, False), (True, False), (True, True)])
def test_small_batch_kernel_over_fp8_weights(device, dtype, rows, n_out, k_in, normed, gated):
    a = torch.randn(rows, k_in, dtype=dtype, device=device)
    w8, ws = _fp8_weight(n_out, k_in, device)
    bias = torch.randn(n_out, dtype=dtype, device=device)
    partials = (torch.rand(2, rows, device=device) + 0.5) * k_in / 2 if normed else None
    got = linear_rows_triton(a, w8, bias, partials, 1e-6, gated=gated, config=SMALL, weight_scale=ws)
    want = linear_rows_reference(a, w8, bias, partials, 1e-6, gated=gated, weight_scale=ws)
    assert_close(got, want, scale=2)
    split = linear_rows_triton(a, w8, bias, partials, 1e-6, gated=gated, weight_scale=ws,
                               config=LaunchConfig(16, 16, 4, 2, split_k=3))  # fmt: skip
    assert_close(split, want, scale=2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_small_batch_residual_kernel_over_fp8_weights(device, dtype):
    a = torch.randn(3, 64, dtype=dtype, device=device)
    w8, ws = _fp8_weight(48, 64, device)
    residual = torch.randn(3, 48, dtype=dtype, device=device)
    gamma = torch.rand(48, dtype=dtype, device=device) + 0.5
    h, norm_in = linear_rows_into_residual_triton(a, w8, residual, gamma, config=SMALL, weight_scale=ws)
    want_h, want_in = linear_rows_into_residual_reference(a, w8, residual, gamma, block_n=16, weight_scale=ws)
    assert_close(h, want_h, scale=2)
    assert_close(norm_in.scaled, want_in.scaled, scale=2)
    torch.testing.assert_close(norm_in.partial_sq, want_in.partial_sq, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_small_batch_qkv_kernel_over_fp8_weights(device, dtype):
    heads, kv_heads, head_dim, k_in, rows = 4, 2, 32, 64, 3
    a = torch.randn(rows, k_in, dtype=dtype, device=device)
    w8, ws = _fp8_weight((heads + 2 * kv_heads) * head_dim, k_in, device)
    positions = torch.tensor([0, 7, 30], device=device)
    cos_sin = build_cos_sin_cache(head_dim, 64, 10000.0, None, dtype, device)
    slots = torch.tensor([2, 9, 17], device=device)
    caches = [torch.zeros(6, 4, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(4)]
    got_q = qkv_rope_store_triton(a, w8, None, None, 0.0, positions, cos_sin, caches[0], caches[1], slots, heads,
                                  kv_heads, block_k=16, weight_scale=ws)  # fmt: skip
    want_q = qkv_rope_store_reference(a, w8, None, None, 0.0, positions, cos_sin, caches[2], caches[3], slots, heads,
                                      kv_heads, weight_scale=ws)  # fmt: skip
    assert_close(got_q, want_q, scale=3)
    assert_close(caches[0], caches[2], scale=3)
    assert_close(caches[1], caches[3], scale=3)


def test_fp8_weights_need_their_scales():
    a = torch.randn(2, 32)
    w8, ws = _fp8_weight(16, 32, "cpu")
    with pytest.raises(ValueError, match="needs its weight_scale"):
        linear_rows_reference(a, w8)
    with pytest.raises(ValueError, match="weight_scale is for e4m3 weights"):
        linear_rows_reference(a, torch.randn(16, 32), weight_scale=ws)
    with pytest.raises(ValueError, match="weight_scale"):
        linear_rows_reference(a, w8, weight_scale=ws[:8])


# The interpreter has no bf16 arithmetic (tolerances.py); a GPU runs bf16 too.
PRODUCER_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantizes_its_rows_as_quantize_rows_does(device, dtype, with_residual):
    """The fused output is exactly the unfused kernel's rows quantized; the references agree the same way."""
    x = (torch.randn(5, 96, device=device) * torch.logspace(-2, 2, 5, device=device)[:, None]).to(dtype)
    weight = (torch.rand(96, device=device) + 0.5).to(dtype)
    residual = torch.randn(5, 96, device=device).to(dtype) if with_residual else None
    for norm in (rms_norm_triton, rms_norm_reference):
        fused, plain = norm(x, weight, 1e-6, residual, quantize=True), norm(x, weight, 1e-6, residual)
        if with_residual:
            assert torch.equal(fused[1], plain[1])
            fused, plain = fused[0], plain[0]
        assert isinstance(fused, QuantizedRows) and fused.dtype == dtype
        q, scale = quantize_rows_reference(plain)
        assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fused.scale, scale)


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
def test_silu_and_mul_quantizes_its_rows_as_quantize_rows_does(device, dtype):
    x = (torch.randn(4, 2 * 200, device=device) * 3).to(dtype)
    for act in (silu_and_mul_triton, silu_and_mul_reference):
        fused = act(x, quantize=True)
        q, scale = quantize_rows_reference(act(x))
        assert isinstance(fused, QuantizedRows) and fused.dtype == dtype
        assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fused.scale, scale)


def test_fp8_linear_takes_quantized_rows():
    x = torch.randn(6, 64)
    w8, ws = _fp8_weight(32, 64, "cpu")
    rows = quantized_rows_reference(x)
    assert torch.equal(fp8_linear(rows, w8, ws), fp8_linear(x, w8, ws))


def test_e4m3_weights_take_their_own_tuned_tiles_first():
    """The FP8 table, then the 16-bit one, then the rule; 16-bit weights never read the FP8 table."""
    for shape, config in small_batch_linear.TUNED_FP8_LINEAR_CONFIGS.items():
        assert choose_config(*shape, fp8_weights=True) == config
        assert choose_config(*shape) == small_batch_linear.TUNED_LINEAR_CONFIGS.get(shape, choose_config(*shape))
        assert choose_config(*shape) != config
    router = (128, 2048, False)  # a 16-bit entry with no FP8 one
    assert router not in small_batch_linear.TUNED_FP8_LINEAR_CONFIGS
    assert choose_config(*router, fp8_weights=True) == small_batch_linear.TUNED_LINEAR_CONFIGS[router]
    assert choose_config(100, 96, fp8_weights=True) == choose_config(100, 96)  # in neither: the rule


@pytest.mark.parametrize("gated", [False, True])
def test_a_launch_over_e4m3_weights_uses_the_fp8_table(device, monkeypatch, gated):
    """Without a config the wrapper looks the shape up as e4m3: here an FP8 entry of one warp and a split of K
    (few warps a program convert the activations fewer times) gives the reference result."""
    rows, n_out, k_in = 2, 48, 96
    entry = LaunchConfig(16, 32, 1, 2, split_k=2)
    monkeypatch.setitem(small_batch_linear.TUNED_FP8_LINEAR_CONFIGS, (n_out, k_in, gated), entry)
    launched = []
    kernel = small_batch_linear.linear_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(small_batch_linear, "linear_rows_kernel", Spy())
    a = torch.randn(rows, k_in, device=device)
    w8, ws = _fp8_weight(2 * n_out if gated else n_out, k_in, device)
    got = linear_rows_triton(a, w8, gated=gated, weight_scale=ws)
    assert launched == [(3, 2)]  # 48 outputs by 16, each K split in two: the FP8 entry's grid
    assert_close(got, linear_rows_reference(a, w8, gated=gated, weight_scale=ws), scale=2)


@pytest.mark.parametrize("block_n", [16, 32])
def test_qkv_half_head_tiles_of_any_width_over_fp8_weights(device, block_n):
    """`block_n` sets the dims of each half a program takes (the sweep's axis); the result does not depend on it."""
    heads, kv_heads, head_dim, k_in, rows = 2, 1, 64, 48, 2
    a = torch.randn(rows, k_in, device=device)
    w8, ws = _fp8_weight((heads + 2 * kv_heads) * head_dim, k_in, device)
    positions = torch.tensor([3, 11], device=device)
    cos_sin = build_cos_sin_cache(head_dim, 32, 10000.0, None, torch.float32, device)
    slots = torch.tensor([1, 6], device=device)
    caches = [torch.zeros(2, 4, kv_heads, head_dim, device=device) for _ in range(4)]
    got_q = qkv_rope_store_triton(a, w8, None, None, 0.0, positions, cos_sin, caches[0], caches[1], slots, heads,
                                  kv_heads, block_k=16, weight_scale=ws, block_n=block_n)  # fmt: skip
    want_q = qkv_rope_store_reference(a, w8, None, None, 0.0, positions, cos_sin, caches[2], caches[3], slots, heads,
                                      kv_heads, weight_scale=ws)  # fmt: skip
    assert_close(got_q, want_q, scale=3)
    assert_close(caches[0], caches[2], scale=3)
    assert_close(caches[1], caches[3], scale=3)
