"""FP8 experts (e4m3 stacks, one fp32 scale per output channel, moe_expert_scales.py): the reference against the
16-bit experts they stand for, every Triton path (grouped GEMMs W8A16 and W8A8, small-batch, folded routing, into
the residual) against the reference, and the refusals of stacks and scales that do not fit."""

import pytest
import torch
from tolerances import DOT_DTYPES, assert_close

import tidal.kernels._moe_config as moe_config
from tidal.kernels._moe_config import GemmTiles, MoeConfig, quantizes_activations
from tidal.kernels._moe_small_batch_config import GemvTiles, SmallBatchMoeConfig
from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.fused_moe import (
    fused_moe_experts_reference,
    fused_moe_experts_triton,
    fused_moe_into_residual_reference,
    fused_moe_into_residual_triton,
    fused_moe_reference,
    fused_moe_triton,
    topk_route_reference,
)
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.moe_expert_scales import ExpertScales
from tidal.kernels.small_batch_linear import NormInput

# Tiles narrower than the shapes below: every program loops over K and each grid has several N-tiles. W8A8's K tiles
# are 32, the least an e4m3 dot takes on a GPU (48 = 32 + a masked tail of 16).
GROUPED = MoeConfig(16, GemmTiles(16, 16, 4, 1), GemmTiles(16, 16, 4, 1), group_m=2)
GROUPED_W8A8 = MoeConfig(16, GemmTiles(16, 32, 4, 1), GemmTiles(16, 32, 4, 1), group_m=2)
# The same tiles with W @ rows^T in the K loop (gate/up swapped, down too in the second).
SWAPPED = MoeConfig(16, GemmTiles(16, 16, 4, 1, swap_ab=True), GemmTiles(16, 16, 4, 1), group_m=2)
SWAPPED_BOTH = MoeConfig(16, GemmTiles(16, 16, 4, 1, swap_ab=True), GemmTiles(16, 16, 4, 1, swap_ab=True), group_m=2)
SWAPPED_W8A8 = MoeConfig(16, GemmTiles(16, 32, 4, 1, swap_ab=True), GemmTiles(16, 32, 4, 1, swap_ab=True), group_m=2)
SMALL = SmallBatchMoeConfig(gate_up=GemvTiles(16, 16, 4), down=GemvTiles(16, 16, 4))


def _quantized(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (e4m3 [E, N, K], scales [E, N]) row by row, as a checkpoint's experts are read in."""
    q, scale = quantize_rows_reference(stack.reshape(-1, stack.shape[-1]))
    return q.view(stack.shape), scale.view(stack.shape[:2])


def _fp8_experts(num_experts, hidden, inter, device, spread=True):
    """Random e4m3 stacks and their scales; `spread` gives every output channel a different magnitude, so a scale
    applied to the wrong channel or expert shows."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) / inter**0.5
    if spread:
        w13 = w13 * torch.rand(num_experts, 2 * inter, 1, device=device).add(0.25) * 4
        w2 = w2 * torch.rand(num_experts, hidden, 1, device=device).add(0.25) * 4
    (q13, s13), (q2, s2) = _quantized(w13), _quantized(w2)
    return q13, q2, ExpertScales(s13, s2)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def test_reference_equals_the_dequantized_experts():
    """Scaling the products equals multiplying by the dequantized fp32 weights (the scales factor out of each sum)."""
    torch.manual_seed(0)
    x = torch.randn(5, 32)
    q13, q2, scales = _fp8_experts(6, 32, 24, "cpu")
    logits = torch.randn(5, 6)
    got = fused_moe_reference(x, q13, q2, logits, 2, True, scales)
    w13, w2 = _dequantized(q13, scales.w13, torch.float32), _dequantized(q2, scales.w2, torch.float32)
    want = fused_moe_reference(x, w13, w2, logits, 2, True)
    assert_close(got, want)


@pytest.mark.parametrize("config", [GROUPED, SWAPPED, SWAPPED_BOTH], ids=["plain", "swapped-gate-up", "swapped"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"), [(1, 8, 2, 32, 24), (7, 10, 4, 48, 32)])
def test_grouped_gemms_match_reference(device, dtype, tokens, num_experts, top_k, hidden, inter, config):
    torch.manual_seed(1)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    q13, q2, scales = _fp8_experts(num_experts, hidden, inter, device)
    weights, ids = topk_route_reference(torch.randn(tokens, num_experts, device=device), top_k, True)
    got = fused_moe_experts_triton(x, q13, q2, weights, ids, config, scales=scales)
    assert got.dtype == dtype
    # The kernels round the intermediate to the dtype, the reference keeps it in fp32; the spread channels make it
    # up to 5x larger than unit weights would (on an H100 one fp16 element of 336 was 1.3x past scale 2).
    assert_close(got, fused_moe_experts_reference(x, q13, q2, weights, ids, scales), scale=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("fold_routing", [True, False])
def test_small_batch_matches_reference(device, dtype, splits, fold_routing):
    torch.manual_seed(2)
    tokens, num_experts, top_k, hidden, inter = 3, 12, 4, 48, 40
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    q13, q2, scales = _fp8_experts(num_experts, hidden, inter, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = SmallBatchMoeConfig(SMALL.gate_up, SMALL.down, down_splits=splits, fold_routing=fold_routing)
    got = fused_moe_triton(x, q13, q2, logits, top_k, True, config=config, scales=scales)
    assert_close(got, fused_moe_reference(x, q13, q2, logits, top_k, True, scales), scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_into_residual_matches_reference(device, dtype):
    torch.manual_seed(3)
    tokens, num_experts, top_k, hidden, inter = 2, 8, 2, 32, 24
    h = torch.randn(tokens, hidden, device=device).to(dtype)
    gamma = torch.rand(hidden, device=device).add(0.5).to(dtype)
    x = NormInput((h.float() * gamma.float()).to(dtype), (h.float() ** 2).sum(dim=1)[None, :].contiguous())
    # Channels of one magnitude: the outputs stay near the residual's, where the tolerances below are meant for
    # (the scales' mapping to channels is what the tests above spread the magnitudes for).
    q13, q2, scales = _fp8_experts(num_experts, hidden, inter, device, spread=False)
    logits = torch.randn(tokens, num_experts, device=device)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    next_gamma = torch.rand(hidden, device=device).add(0.5).to(dtype)
    args = (x, 1e-6, q13, q2, logits, top_k, True, residual, next_gamma)
    got_h, got_next = fused_moe_into_residual_triton(*args, SMALL, scales)
    want_h, want_next = fused_moe_into_residual_reference(*args, scales)
    assert_close(got_h, want_h, scale=2.0)
    assert_close(got_next.scaled, want_next.scaled, scale=2.0)
    torch.testing.assert_close(got_next.partial_sq.sum(dim=0), want_next.partial_sq.sum(dim=0), rtol=3e-2, atol=1e-2)


def test_stacks_and_scales_that_do_not_fit_are_refused():
    x = torch.randn(2, 32)
    q13, q2, scales = _fp8_experts(4, 32, 16, "cpu", spread=False)
    logits = torch.randn(2, 4)
    with pytest.raises(ValueError, match="hidden, w13 and w2 must share one dtype"):
        fused_moe_reference(x, q13, q2, logits, 2, True)  # e4m3 stacks without their scales
    with pytest.raises(ValueError, match="w13 must have dtype"):
        fused_moe_reference(x, q13.float(), q2, logits, 2, True, scales)  # scales for 16/32-bit stacks
    with pytest.raises(ValueError, match=r"scales\.w13 must have shape \(4, 32\)"):
        fused_moe_reference(x, q13, q2, logits, 2, True, ExpertScales(scales.w13[:, :16], scales.w2))
    with pytest.raises(ValueError, match=r"scales\.w2 must have dtype"):
        fused_moe_reference(x, q13, q2, logits, 2, True, ExpertScales(scales.w13, scales.w2.half()))
    with pytest.raises(ValueError, match=r"scales\.w13 must be contiguous"):
        fused_moe_reference(x, q13, q2, logits, 2, True, ExpertScales(scales.w13.t().contiguous().t(), scales.w2))
    assert q13.dtype == FP8_E4M3


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(100, 6, 2), (40, 4, 4)])
def test_many_rows_per_expert_run_w8a8_as_the_reference_computes_it(
    device, dtype, tokens, num_experts, top_k, monkeypatch
):
    """Past FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT the grouped GEMMs quantize hidden's and the intermediate's rows too
    (FP8 tensor cores): they match the reference that quantizes the same rows, and stay near the W8A16 result."""
    monkeypatch.setattr(moe_config, "FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT", 32)
    assert quantizes_activations(tokens, top_k, num_experts)
    torch.manual_seed(4)
    hidden, inter = 48, 32
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    q13, q2, scales = _fp8_experts(num_experts, hidden, inter, device)
    weights, ids = topk_route_reference(torch.randn(tokens, num_experts, device=device), top_k, True)
    got = fused_moe_experts_triton(x, q13, q2, weights, ids, GROUPED_W8A8, scales=scales)
    w8a8 = fused_moe_experts_reference(x, q13, q2, weights, ids, scales, fp8_activations=True)
    assert_close(got, w8a8, scale=4.0)
    swapped = fused_moe_experts_triton(x, q13, q2, weights, ids, SWAPPED_W8A8, scales=scales)
    assert_close(swapped, w8a8, scale=4.0)
    w8a16 = fused_moe_experts_reference(x, q13, q2, weights, ids, scales)
    assert (got.float() - w8a16.float()).norm() / w8a16.float().norm() < 0.08  # e4m3 rows: ~3% per operand
    with pytest.raises(ValueError, match="W8A8 grouped GEMMs need K tiles of at least 32"):
        fused_moe_experts_triton(x, q13, q2, weights, ids, GROUPED, scales=scales)  # K tiles of 16


def test_the_activations_are_quantized_only_where_the_experts_get_many_rows(monkeypatch):
    # The threshold as measured (96 rows per expert): Qwen3-30B-A3B's decode and 1024-token prefill stay W8A16,
    # its 1536-token prefill chunks go W8A8.
    assert not quantizes_activations(256, 8, 128) and not quantizes_activations(1024, 8, 128)
    assert quantizes_activations(1536, 8, 128) and quantizes_activations(8192, 8, 128)
    monkeypatch.setattr(moe_config, "FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT", None)
    assert not quantizes_activations(8192, 8, 128)  # off: W8A16 throughout
    monkeypatch.setattr(moe_config, "FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT", 32)
    assert not quantizes_activations(1, 8, 128) and not quantizes_activations(256, 8, 128)  # decode: 16 rows each
    assert quantizes_activations(512, 8, 128) and quantizes_activations(1024, 2, 8)  # prefill
    with pytest.raises(ValueError, match="fp8_activations is for FP8 experts"):
        x = torch.randn(2, 16)
        fused_moe_experts_reference(x, torch.randn(2, 8, 16), torch.randn(2, 16, 4), torch.ones(2, 1),
                                    torch.zeros(2, 1, dtype=torch.int32), fp8_activations=True)  # fmt: skip
