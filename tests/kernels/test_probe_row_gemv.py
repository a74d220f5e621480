"""The one-row sweep (benchmarks/kernels/probe_row_gemv.py) calls the engine's projections as the decode step does,
and its reference is theirs: every epilogue, small and interpreted on a CPU, compiled on a GPU."""

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

import probe_row_gemv

from tidal.kernels.small_batch_linear import LaunchConfig, OneRowConfig


@pytest.mark.parametrize("epilogue", ["residual", "row_scale", "gated", "plain"])
@pytest.mark.parametrize("fp8", [False, True])
def test_each_case_matches_its_reference_on_both_kernels(device, epilogue, fp8):
    case = probe_row_gemv.Case(probe_row_gemv.Projection(24, 96, epilogue), fp8, device, layers=1)
    assert case.fp8 == fp8
    # The tiled kernel's bf16 tensor-core dot has no interpreted equivalent (tolerances.DOT_DTYPES): GPU only.
    tiled = (LaunchConfig(16, 32, 4, 2),) if device == "cuda" else ()
    for config in (OneRowConfig(4, 32, 2), *tiled):
        assert probe_row_gemv.relative_error(case, config) < 3e-2, config


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_qkv_case_matches_its_reference(device, qk_norm, fp8):
    projection = probe_row_gemv.Projection(128, 48, "qkv", heads=(2, 1, 32), qk_norm=qk_norm)
    case = probe_row_gemv.Case(projection, fp8, device, layers=1)
    assert probe_row_gemv.relative_error(case, probe_row_gemv.OneRowConfig(4, 16, 2)) < 3e-2
    if device == "cuda":  # the tiled qkv kernel's defaults: a tensor-core dot
        assert probe_row_gemv.relative_error(case, None) < 3e-2


def test_the_router_and_lm_heads_stay_16_bit_as_the_engine_keeps_them(device):
    case = probe_row_gemv.Case(probe_row_gemv.Projection(8, 32, "plain", fp8_capable=False), True, device, layers=1)
    assert not case.fp8 and case.weights[0][1] is None


def test_the_variants_fit_the_registers_and_load_enough():
    for gated, itemsize in itertools.product((False, True), (1, 2)):
        variants = probe_row_gemv.one_row_variants(gated, 4096, itemsize)
        streamed = [v for v in variants if not v.weights_first]
        limit = 32 if gated else 64
        assert streamed and all(1024 <= v.block_n * v.block_k <= limit * 32 * v.num_warps for v in streamed)
        # Weights-first programs hold their whole rows: each one the launch would take (its register budget).
        weights_first = [v for v in variants if v.weights_first]
        assert weights_first
        for v in weights_first:
            v.launch_block_k(4096, v.block_n * (2 if gated else 1), itemsize)
