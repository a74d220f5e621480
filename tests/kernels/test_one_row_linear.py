"""The one-row projection as a row-parallel GEMV (`OneRowConfig`): every epilogue of linear_rows, 16-bit and e4m3
weights, against the torch references; and which shapes take it."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.rms_norm import rms_norm_reference
from tidal.kernels.small_batch_linear import (
    TUNED_ONE_ROW_CONFIGS,
    LaunchConfig,
    OneRowConfig,
    choose_one_row_config,
    linear_rows_into_residual_reference,
    linear_rows_into_residual_triton,
    linear_rows_reference,
    linear_rows_triton,
)

# Small tiles so the interpreter runs several programs and several K steps, with ragged edges in both.
ONE_ROW = OneRowConfig(block_n=4, block_k=32, num_warps=2)
SHAPES = [(48, 80), (37, 64), (5, 33)]  # (out, in)


def _inputs(n_out, k_in, dtype, device, fp8):
    a = torch.randn(1, k_in, dtype=dtype, device=device)
    weight = torch.randn(n_out, k_in, dtype=dtype, device=device) / k_in**0.5
    if fp8:
        w8, scale = quantize_rows_reference(weight.float())
        return a, w8.to(device), scale.to(device)
    return a, weight, None


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("n_out", "k_in"), SHAPES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("normed", "bias"), [(False, False), (False, True), (True, True)])
def test_one_row_matches_the_reference(device, dtype, n_out, k_in, fp8, normed, bias):
    a, weight, scale = _inputs(n_out, k_in, dtype, device, fp8)
    b = torch.randn(n_out, dtype=dtype, device=device) if bias else None
    # Three partial sums of squares, as a previous kernel's programs leave them (more than one load of BLOCK_P: no).
    partials = (torch.rand(3, 1, device=device) + 0.5) * k_in / 3 if normed else None
    got = linear_rows_triton(a, weight, b, partials, 1e-6, config=ONE_ROW, weight_scale=scale)
    assert_close(got, linear_rows_reference(a, weight, b, partials, 1e-6, weight_scale=scale), scale=2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_gated_is_silu_and_mul(device, dtype, fp8):
    a, weight, scale = _inputs(2 * 37, 64, dtype, device, fp8)
    bias = torch.randn(2 * 37, dtype=dtype, device=device)
    partials = torch.rand(2, 1, device=device) + 20.0
    got = linear_rows_triton(a, weight, bias, partials, 1e-6, gated=True, config=ONE_ROW, weight_scale=scale)
    want = linear_rows_reference(a, weight, bias, partials, 1e-6, gated=True, weight_scale=scale)
    assert got.shape == (1, 37)
    assert_close(got, want, scale=2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("n_out", "k_in"), SHAPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_into_residual_leaves_one_partial_a_program(device, dtype, n_out, k_in, fp8):
    a, weight, scale = _inputs(n_out, k_in, dtype, device, fp8)
    residual = torch.randn(1, n_out, dtype=dtype, device=device)
    gamma = torch.rand(n_out, dtype=dtype, device=device) + 0.5
    got_h, got = linear_rows_into_residual_triton(a, weight, residual, gamma, config=ONE_ROW, weight_scale=scale)
    want_h, want = linear_rows_into_residual_reference(a, weight, residual, gamma, block_n=ONE_ROW.block_n,
                                                       weight_scale=scale)  # fmt: skip
    assert_close(got_h, want_h, scale=2)
    assert_close(got.scaled, want.scaled, scale=2)
    assert got.partial_sq.shape == want.partial_sq.shape == (-(-n_out // ONE_ROW.block_n), 1)
    torch.testing.assert_close(got.partial_sq, want.partial_sq, rtol=1e-2, atol=1e-3)
    # The next one-row projection reads those partials as the norm of h.
    normed_next = linear_rows_triton(got.scaled, torch.eye(n_out, dtype=dtype, device=device), None,
                                     got.partial_sq, 1e-6, config=ONE_ROW)  # fmt: skip
    assert_close(normed_next, rms_norm_reference(got_h, gamma, 1e-6), scale=3)


# Whole rows loaded before the wait: BLOCK_K is K rounded up (block_k ignored), ragged K masked.
WEIGHTS_FIRST = OneRowConfig(block_n=4, block_k=32, num_warps=2, weights_first=True)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("epilogue", ["normed_bias", "gated", "residual"])
def test_weights_first_equals_the_streamed_kernel(device, fp8, epilogue):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_out, k_in = 37, 80
    a, weight, scale = _inputs(2 * n_out if epilogue == "gated" else n_out, k_in, dtype, device, fp8)
    if epilogue == "residual":
        residual = torch.randn(1, n_out, dtype=dtype, device=device)
        gamma = torch.rand(n_out, dtype=dtype, device=device) + 0.5
        (h, got), (want_h, want) = (linear_rows_into_residual_triton(a, weight, residual, gamma, config=config,
                                                                     weight_scale=scale)
                                    for config in (WEIGHTS_FIRST, ONE_ROW))  # fmt: skip
        torch.testing.assert_close(h, want_h)
        torch.testing.assert_close(got.partial_sq, want.partial_sq, rtol=1e-5, atol=1e-5)
        return
    bias = torch.randn(weight.shape[0], dtype=dtype, device=device)
    partials = torch.rand(3, 1, device=device) + 20.0
    got, want = (linear_rows_triton(a, weight, bias, partials, 1e-6, gated=epilogue == "gated", config=config,
                                    weight_scale=scale) for config in (WEIGHTS_FIRST, ONE_ROW))  # fmt: skip
    assert got.shape == (1, n_out)
    assert_close(got, want, scale=1)


def test_a_weights_first_tile_past_its_registers_is_refused(device):
    a = torch.randn(1, 4096, device=device)
    too_wide = OneRowConfig(block_n=16, block_k=512, num_warps=2, weights_first=True)  # 4 KiB of rows a thread
    with pytest.raises(ValueError, match="holds 4096 bytes of them a thread, over the 256"):
        linear_rows_triton(a, torch.randn(16, 4096, device=device), config=too_wide)


def test_the_tiled_kernel_and_the_row_gemv_agree(device):
    a, weight, _ = _inputs(40, 96, torch.float32, device, fp8=False)
    tiled = linear_rows_triton(a, weight, config=LaunchConfig(16, 32, 4, 2))
    assert_close(linear_rows_triton(a, weight, config=ONE_ROW), tiled, scale=2)
    assert_close(tiled, F.linear(a, weight), scale=2)


def test_only_measured_shapes_take_the_row_gemv_by_default():
    for (n_out, k_in, gated, fp8), config in TUNED_ONE_ROW_CONFIGS.items():
        assert choose_one_row_config(n_out, k_in, gated, fp8) == config
    assert choose_one_row_config(4096, 4096, False, False) is None  # the 8B's o: the tiled kernel, as measured
    assert choose_one_row_config(2048, 4096, False, False) is None  # Qwen3's o in 16 bits: not measured


def test_a_one_row_config_refuses_more_rows(device):
    a = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="one-row config launches one row, got 2"):
        linear_rows_triton(a, torch.randn(8, 32, device=device), config=ONE_ROW)
