"""Small-batch linear layers with RMSNorm, SiLU-and-mul and the residual add in their epilogues: Triton vs torch."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels._split_k import arrival_counters
from tidal.kernels.activation import silu_and_mul_reference
from tidal.kernels.rms_norm import rms_norm_reference
from tidal.kernels.small_batch_linear import (
    MAX_ROWS,
    LaunchConfig,
    linear_rows_into_residual_reference,
    linear_rows_into_residual_triton,
    linear_rows_reference,
    linear_rows_triton,
    norm_input_reference,
)

# Small tiles so the interpreter runs several programs and several K steps, with ragged edges in both.
SMALL = LaunchConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
SHAPES = [(1, 48, 80), (3, 37, 64), (8, 100, 96), (MAX_ROWS, 16, 33)]  # (rows, out, in)


def _inputs(rows, n_out, k_in, dtype, device, bias):
    a = torch.randn(rows, k_in + 5, dtype=dtype, device=device)[:, :k_in]  # strided rows
    weight = torch.randn(n_out, k_in, dtype=dtype, device=device) / k_in**0.5
    b = torch.randn(n_out, dtype=dtype, device=device) if bias else None
    return a, weight, b


def _partials(h, parts):
    """h [M, H] -> [parts, M] sums of h^2 over `parts` column ranges (a previous kernel's programs)."""
    hf = h.float()
    return torch.stack([c.pow(2).sum(dim=1) for c in hf.chunk(parts, dim=1)]).contiguous()


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "n_out", "k_in"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_plain_matches_reference(device, dtype, rows, n_out, k_in, bias):
    a, weight, b = _inputs(rows, n_out, k_in, dtype, device, bias)
    assert_close(linear_rows_triton(a, weight, b, config=SMALL), F.linear(a, weight, b), scale=2)
    assert_close(linear_rows_reference(a, weight, b), F.linear(a, weight, b), scale=2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "n_out", "k_in"), SHAPES)
@pytest.mark.parametrize("parts", [1, 3, 70])  # 70: more partial sums than one BLOCK_P
def test_row_scale_is_the_rms_norm_before_the_linear(device, dtype, rows, n_out, k_in, parts):
    h = torch.randn(rows, k_in, dtype=dtype, device=device) * 3 + 1  # mean far from 0, scale far from 1
    gamma = torch.rand(k_in, dtype=dtype, device=device) + 0.5
    _, weight, bias = _inputs(rows, n_out, k_in, dtype, device, bias=True)
    scaled = norm_input_reference(h, gamma).scaled
    got = linear_rows_triton(scaled, weight, bias, _partials(h, min(parts, k_in)), 1e-5, config=SMALL)
    want = F.linear(rms_norm_reference(h, gamma, 1e-5), weight, bias)  # the unfused layers
    assert_close(got, want, scale=3)  # rounding h * gamma instead of h * gamma / rms


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "inter", "k_in"), SHAPES)
@pytest.mark.parametrize("normed", [False, True])
def test_gated_is_silu_and_mul_after_the_linear(device, dtype, rows, inter, k_in, normed):
    a, weight, bias = _inputs(rows, 2 * inter, k_in, dtype, device, bias=True)
    partials = _partials(a * 2, 2) if normed else None
    got = linear_rows_triton(a, weight, bias, partials, 1e-6, gated=True, config=SMALL)
    want = linear_rows_reference(a, weight, bias, partials, 1e-6, gated=True)
    assert_close(got, want, scale=2)
    if not normed:
        assert_close(got, silu_and_mul_reference(F.linear(a, weight, bias)), scale=3)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("rows", "n_out", "k_in"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_into_residual_matches_reference(device, dtype, rows, n_out, k_in, bias):
    a, weight, b = _inputs(rows, n_out, k_in, dtype, device, bias)
    residual = torch.randn(rows, n_out + 2, dtype=dtype, device=device)[:, :n_out]  # strided rows
    gamma = torch.rand(n_out, dtype=dtype, device=device) + 0.5
    got_h, got = linear_rows_into_residual_triton(a, weight, residual, gamma, b, config=SMALL)
    want_h, want = linear_rows_into_residual_reference(a, weight, residual, gamma, b, block_n=SMALL.block_n)
    assert_close(got_h, want_h, scale=2)
    assert_close(got.scaled, want.scaled, scale=2)
    assert got.partial_sq.shape == want.partial_sq.shape == (-(-n_out // SMALL.block_n), rows)
    torch.testing.assert_close(got.partial_sq, want.partial_sq, rtol=1e-2, atol=1e-3)
    # And what the next layer makes of it equals the unfused residual add + RMSNorm of that h.
    normed_next = linear_rows_reference(got.scaled, torch.eye(n_out, dtype=dtype, device=device), None,
                                        got.partial_sq, 1e-6)  # fmt: skip
    assert_close(normed_next, rms_norm_reference(got_h, gamma, 1e-6), scale=3)


def test_norm_input_reference_is_one_partial_per_row():
    h = torch.randn(3, 10)
    gamma = torch.rand(10)
    got = norm_input_reference(h, gamma)
    assert got.partial_sq.shape == (1, 3)
    torch.testing.assert_close(got.partial_sq[0], h.pow(2).sum(dim=1))
    torch.testing.assert_close(got.scaled, h * gamma)


def test_default_config_handles_ragged_shapes(device):
    a, weight, bias = _inputs(2, 200, 300, torch.float16, device, bias=True)
    assert_close(linear_rows_triton(a, weight, bias), F.linear(a, weight, bias), scale=2)


def test_rejects_bad_inputs():
    a = torch.randn(2, 8)
    with pytest.raises(ValueError, match="input features"):
        linear_rows_triton(a, torch.randn(4, 9))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear_rows_triton(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="even"):
        linear_rows_triton(a, torch.randn(5, 8), gated=True)
    with pytest.raises(ValueError, match="one column per row"):
        linear_rows_triton(a, torch.randn(4, 8), norm_partials=torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype"):
        linear_rows_triton(a, torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual"):
        linear_rows_into_residual_triton(a, torch.randn(4, 8), torch.randn(2, 5), torch.randn(4))


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("split_k", [2, 3, 5])  # 5 over 80 inputs in steps of 32: the last split has no K at all
@pytest.mark.parametrize("variant", ["plain", "row_scale", "gated", "into_residual"])
def test_split_k_equals_the_unsplit_kernel(device, dtype, split_k, variant):
    """The split programs' partials summed by the last one to arrive, with every epilogue: the unsplit result up to
    the fp32 order of the sum, and the counters back at zero for the next launch."""
    rows, n_out, k_in = 3, 48, 80
    a, weight, b = _inputs(rows, 2 * n_out if variant == "gated" else n_out, k_in, dtype, device, bias=True)
    split = LaunchConfig(SMALL.block_n, SMALL.block_k, SMALL.num_warps, SMALL.num_stages, split_k=split_k)
    partials = _partials(a.float() * 3, 4)
    if variant == "into_residual":
        residual = torch.randn(rows, n_out, dtype=dtype, device=device)
        gamma = torch.rand(n_out, dtype=dtype, device=device) + 0.5
        got_h, got = linear_rows_into_residual_triton(a, weight, residual, gamma, b, config=split)
        want_h, want = linear_rows_into_residual_triton(a, weight, residual, gamma, b, config=SMALL)
        assert_close(got_h, want_h)
        assert_close(got.scaled, want.scaled)
        torch.testing.assert_close(got.partial_sq, want.partial_sq, rtol=1e-2, atol=1e-3)
    else:
        kwargs = {"norm_partials": partials, "eps": 1e-6} if variant != "plain" else {}
        gated = variant == "gated"
        got = linear_rows_triton(a, weight, b, gated=gated, config=split, **kwargs)
        assert_close(got, linear_rows_triton(a, weight, b, gated=gated, config=SMALL, **kwargs))
        assert_close(got, linear_rows_reference(a, weight, b, gated=gated, **kwargs), scale=3)
    assert not arrival_counters(torch.device(device), 1).any()


def test_split_k_runs_are_bitwise_equal(device):
    """Which split arrives last varies from run to run on a GPU; the sum's order does not."""
    a, weight, _ = _inputs(2, 64, 256, torch.float32, device, bias=False)
    config = LaunchConfig(16, 32, 4, 2, split_k=4)
    first = linear_rows_triton(a, weight, config=config)
    for _ in range(50 if device == "cuda" else 3):
        assert torch.equal(linear_rows_triton(a, weight, config=config), first)


def test_split_k_must_be_positive(device):
    a, weight, _ = _inputs(1, 16, 16, torch.float32, device, bias=False)
    with pytest.raises(ValueError, match="split_k"):
        linear_rows_triton(a, weight, config=LaunchConfig(16, 16, 4, 2, split_k=0))
