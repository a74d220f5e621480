"""The small-batch MoE path (per-pair matrix-vector products, routing folded in) vs the torch reference, and the
choice between it and the grouped GEMMs.

Its kernels use no tl.dot, so bf16 is checked on CPU too (the interpreter's bf16 tl.dot is what keeps the grouped
path's bf16 tests on the GPU, see tolerances.py)."""

import pytest
import torch
from tolerances import assert_close

import tidal.worker.layers.moe as moe_layer
from tidal.kernels._moe_small_batch_config import (
    DEFAULT_MAX_EXPERT_WIDTH,
    DEFAULT_MAX_PAIRS,
    TUNED_FP8_SMALL_BATCH_CONFIGS,
    TUNED_SMALL_BATCH_CONFIGS,
    GemvTiles,
    SmallBatchMoeConfig,
    default_small_batch_config,
    down_splits,
    fit_tiles,
    small_batch_moe_config,
)
from tidal.kernels._split_k import arrival_counters
from tidal.kernels.fused_moe import (
    auto_small_batch_config,
    fused_moe_experts_reference,
    fused_moe_experts_triton,
    fused_moe_into_residual_reference,
    fused_moe_into_residual_triton,
    fused_moe_reference,
    fused_moe_triton,
    topk_route_triton,
)
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.small_batch_linear import NormInput

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Tiles narrower than the test shapes, so each program loops over K and the grid has several N-tiles.
TINY = SmallBatchMoeConfig(gate_up=GemvTiles(16, 16, 4), down=GemvTiles(16, 16, 4))


def _weights(num_experts, hidden, inter, dtype, device):
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device).div(hidden**0.5).to(dtype)
    w2 = torch.randn(num_experts, hidden, inter, device=device).div(inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter"),
    [
        (1, 16, 8, 64, 48),  # Qwen3-MoE-like: top-8, I not a multiple of the tile
        (2, 100, 8, 32, 16),  # the folded routing ranks 100 experts in 4 chunks, the last one part padding
        (4, 8, 2, 48, 40),  # Mixtral-like: 8 experts, top-2; H and I not multiples of the tiles
        (3, 6, 1, 32, 16),
        (2, 130, 4, 32, 16),  # past 128 experts the folded routing picks the top k one by one
    ],
)
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routed_small_batch_matches_reference(device, dtype, tokens, num_experts, top_k, hidden, inter, splits,
                                              renormalize):  # fmt: skip
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=splits)
    got = fused_moe_triton(x, w13, w2, logits, top_k, renormalize, config=config)
    assert got.dtype == dtype
    assert_close(got, fused_moe_reference(x, w13, w2, logits, top_k, renormalize), scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize(("gate_up_n", "down_n"), [(1, 1), (2, 4)])
def test_row_gemv_tiles_match_reference(device, dtype, splits, gate_up_n, down_n):
    """The row GEMV's narrow tiles (sweep_moe_small_batch.py --row-gemv): one to a few outputs a program, K steps
    past the hidden and expert widths (masked), every pair's K in one step."""
    tokens, num_experts, top_k, hidden, inter = 1, 16, 8, 64, 48
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = SmallBatchMoeConfig(GemvTiles(gate_up_n, 128, 2), GemvTiles(down_n, 64, 2), down_splits=splits)
    got = fused_moe_triton(x, w13, w2, logits, top_k, True, config=config)
    assert_close(got, fused_moe_reference(x, w13, w2, logits, top_k, True), scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4, 8])
def test_experts_repeated_across_tokens(device, dtype, splits):
    """Tokens sharing experts (and one token's pairs in a non-sorted order) with given routing weights."""
    tokens, num_experts, top_k, hidden, inter = 4, 10, 8, 32, 24
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int()
    ids[1] = ids[0]  # two tokens on the very same experts
    ids[2] = ids[0].flip(0)  # the same experts in the other order
    ids, weights = ids.to(device), torch.rand(tokens, top_k, device=device)
    config = SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=splits)
    got = fused_moe_experts_triton(x, w13, w2, weights, ids, config=config)
    assert_close(got, fused_moe_experts_reference(x, w13, w2, weights, ids), scale=2.0)


def test_default_tiles_on_a_wider_shape_and_no_tokens(device):
    """The default config's tiles (fitted to the shape), and an empty batch."""
    tokens, num_experts, top_k, hidden, inter = 2, 8, 2, 512, 272
    x = torch.randn(tokens, hidden, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = default_small_batch_config(top_k)
    got = fused_moe_triton(x, w13, w2, logits, top_k, True, config=config)
    assert_close(got, fused_moe_reference(x, w13, w2, logits, top_k, True))
    empty = fused_moe_triton(x[:0], w13, w2, logits[:0], top_k, True, config=config)
    assert empty.shape == (0, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_in_a_launch_of_its_own(device, dtype):
    tokens, num_experts, top_k, hidden, inter = 2, 8, 2, 32, 24
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = SmallBatchMoeConfig(TINY.gate_up, TINY.down, fold_routing=False)
    got = fused_moe_triton(x, w13, w2, logits, top_k, True, config=config)
    assert_close(got, fused_moe_reference(x, w13, w2, logits, top_k, True), scale=2.0)


def test_routing_folded_into_the_kernel_picks_what_topk_picks(device):
    """Equal logits (ties) take the experts the top-k kernel takes (the lowest ids; torch.topk on a CPU does not)."""
    tokens, num_experts, top_k, hidden, inter = 2, 8, 3, 32, 16
    x = torch.randn(tokens, hidden, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, device)
    logits = torch.zeros(tokens, num_experts, device=device)
    logits[0, 5] = 1.0
    weights, ids = topk_route_triton(logits, top_k, False)
    assert ids.tolist() == [[5, 0, 1], [0, 1, 2]]
    want = fused_moe_experts_reference(x, w13, w2, weights, ids)
    assert_close(fused_moe_triton(x, w13, w2, logits, top_k, False, config=TINY), want)


def test_the_path_follows_the_shapes_and_the_switch(monkeypatch):
    w13 = torch.empty(8, 2 * 16, 32)
    assert auto_small_batch_config(1, 2, w13) == default_small_batch_config(2)
    assert auto_small_batch_config(DEFAULT_MAX_PAIRS // 2, 2, w13) == default_small_batch_config(2)
    assert auto_small_batch_config(DEFAULT_MAX_PAIRS // 2 + 1, 2, w13) is None
    assert auto_small_batch_config(0, 2, w13) is None
    # Mixtral-wide experts stay on the grouped GEMMs until a sweep tunes them (meta: shapes only).
    wide = torch.empty(8, 2 * (DEFAULT_MAX_EXPERT_WIDTH + 1), 32, device="meta")
    assert auto_small_batch_config(1, 2, wide) is None
    monkeypatch.setenv("TIDAL_MOE_SMALL_BATCH", "0")
    assert auto_small_batch_config(1, 2, w13) is None


def test_a_tuned_shape_takes_its_table(monkeypatch):
    shape = (128, 8, 2048, 768)
    wide = SmallBatchMoeConfig(GemvTiles(32, 512, 8), GemvTiles(8, 256, 4), down_splits=2)
    monkeypatch.setitem(TUNED_SMALL_BATCH_CONFIGS, shape, ((1, TINY), (4, wide)))
    assert small_batch_moe_config(1, 8, 128, 2048, 768) == TINY
    assert small_batch_moe_config(3, 8, 128, 2048, 768) == wide
    assert small_batch_moe_config(5, 8, 128, 2048, 768) is None  # past the table: grouped GEMMs


def test_e4m3_experts_take_their_table_for_the_counts_it_has(monkeypatch):
    """The FP8 entries first; a count past them takes the 16-bit entry, and past that the grouped GEMMs still."""
    shape = (128, 8, 2048, 768)
    wide = SmallBatchMoeConfig(GemvTiles(32, 512, 8), GemvTiles(8, 256, 4), down_splits=2)
    fp8_one = SmallBatchMoeConfig(GemvTiles(32, 1024, 4, 3), GemvTiles(8, 512, 4), down_splits=8)
    monkeypatch.setitem(TUNED_SMALL_BATCH_CONFIGS, shape, ((1, TINY), (4, wide)))
    monkeypatch.setitem(TUNED_FP8_SMALL_BATCH_CONFIGS, shape, ((1, fp8_one),))
    assert small_batch_moe_config(1, 8, 128, 2048, 768, fp8_experts=True) == fp8_one
    assert small_batch_moe_config(1, 8, 128, 2048, 768) == TINY  # 16-bit experts never read the FP8 table
    assert small_batch_moe_config(3, 8, 128, 2048, 768, fp8_experts=True) == wide
    assert small_batch_moe_config(5, 8, 128, 2048, 768, fp8_experts=True) is None
    # The wrapper tells e4m3 stacks apart by their dtype (meta: shapes only).
    w13 = torch.empty(128, 2 * 768, 2048, dtype=FP8_E4M3, device="meta")
    assert auto_small_batch_config(1, 8, w13) == fp8_one
    assert auto_small_batch_config(1, 8, w13.to(torch.bfloat16)) == TINY


def test_default_down_tiles_keep_one_step_of_loads_near_constant():
    assert default_small_batch_config(8).down == GemvTiles(16, 64, 4)  # Qwen3-30B-A3B: 8 pairs side by side
    assert default_small_batch_config(2).down == GemvTiles(16, 256, 4)  # Mixtral
    assert default_small_batch_config(6).down == default_small_batch_config(8).down  # padded to 8 slots


def test_tiles_fit_small_problems_and_splits_divide_top_k():
    assert fit_tiles(GemvTiles(64, 512, 4), 24, 40) == GemvTiles(32, 64, 4)
    assert fit_tiles(GemvTiles(16, 256, 4), 768, 2048) == GemvTiles(16, 256, 4)
    assert down_splits(SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=4), 8) == 4
    assert down_splits(SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=4), 2) == 2
    assert down_splits(SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=4), 3) == 1


def test_the_moe_layer_takes_the_small_batch_path(device, monkeypatch):
    """SparseMoE's forward with the Triton op (interpreted on CPU): a decode-sized batch takes the small-batch path
    and gives the reference's output."""
    from tidal.kernels import fused_moe_small_batch

    names = moe_layer.ExpertCheckpointNames(block="mlp", router="gate", gate="gate_proj", up="up_proj",
                                            down="down_proj")  # fmt: skip
    spec = moe_layer.MoeSpec(num_experts=8, top_k=2, expert_intermediate_size=24, renormalize=True, names=names)
    layer = moe_layer.SparseMoE(32, spec, torch.float32, torch.device(device))
    for weight in (layer.router, layer.w13, layer.w2):
        weight.data.normal_(std=0.2)
    x = torch.randn(3, 32, device=device)
    want = fused_moe_reference(x, layer.w13, layer.w2, x @ layer.router.t(), 2, True)
    calls = []
    routed = fused_moe_small_batch.small_batch_moe_routed
    monkeypatch.setattr("tidal.kernels.fused_moe.small_batch_moe_routed", lambda *a: calls.append(1) or routed(*a))
    monkeypatch.setattr(moe_layer, "fused_moe", fused_moe_triton)
    with torch.no_grad():
        assert_close(layer(x), want)
    assert calls == [1]


def _norm_input(h: torch.Tensor, gamma: torch.Tensor, num_partials: int) -> NormInput:
    """h's NormInput with its sums of squares split over `num_partials` column ranges, as a projection writes them."""
    hf = h.float()
    sq = torch.stack([c.sum(dim=1) for c in (hf * hf).chunk(num_partials, dim=1)]).contiguous()  # [P, T]
    return NormInput((hf * gamma.float()).to(h.dtype), sq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("fold_routing", [True, False])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"), [(1, 16, 8, 64, 48), (3, 8, 2, 48, 40)])
def test_into_residual_matches_reference(device, dtype, splits, fold_routing, tokens, num_experts, top_k, hidden,
                                         inter):  # fmt: skip
    """The decoder layer's form: the MoE of rms_norm(h) from the norm's unscaled input, added into the residual
    stream, with the next norm's input written by the down pass (by the last split of each tile when split)."""
    h = (torch.randn(tokens, hidden, device=device) * 3).to(dtype)  # rms far from 1: a missing 1/rms shows
    gamma = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    next_gamma = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    logits = torch.randn(tokens, num_experts, device=device)
    x = _norm_input(h, gamma, num_partials=3)
    eps = 1e-6
    config = SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=splits, fold_routing=fold_routing)
    got_h, got_next = fused_moe_into_residual_triton(
        x, eps, w13, w2, logits, top_k, True, residual, next_gamma, config
    )  # fmt: skip
    want_h, want_next = fused_moe_into_residual_reference(x, eps, w13, w2, logits, top_k, True, residual, next_gamma)
    assert got_h.dtype == dtype and got_next.scaled.dtype == dtype
    assert_close(got_h, want_h, scale=2.0)
    assert_close(got_next.scaled, want_next.scaled, scale=2.0)
    # One partial sum per H-tile of the launch that wrote h; their total is h's sum of squares.
    assert got_next.partial_sq.shape[1] == tokens
    torch.testing.assert_close(got_next.partial_sq.sum(dim=0), got_h.float().pow(2).sum(dim=1), rtol=1e-5, atol=1e-5)


PIPELINED_SHAPES = [(1, 16, 8, 80, 48), (3, 8, 2, 48, 112)]  # (tokens, experts, top_k, hidden, inter)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"), PIPELINED_SHAPES)
def test_pipelined_k_loops_give_the_same_bits(device, splits, tokens, num_experts, top_k, hidden, inter):
    """Loads in flight over several K steps (through shared memory) change when bytes arrive, not the sums: the
    same bits as one step at a time, with K and N not multiples of the 32-wide tiles (masked last steps). K is a
    multiple of 16, as a model's is: Triton pipelines only loads of 4 or more aligned bytes, so a K it cannot prove
    16-divisible would compile every stage count to the same loop. The interpreter runs tl.range's stages as one
    loop, so only a GPU can tell them apart."""
    if device == "cpu":
        pytest.skip("the Triton interpreter does not pipeline: every stage count is the same loop there")
    h = (torch.randn(tokens, hidden, device=device) * 3).to(torch.bfloat16)
    gamma = (torch.rand(hidden, device=device) + 0.5).to(torch.bfloat16)
    residual = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    w13, w2 = _weights(num_experts, hidden, inter, torch.bfloat16, device)
    logits = torch.randn(tokens, num_experts, device=device)
    x = _norm_input(h, gamma, num_partials=2)

    def run(stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = GemvTiles(32, 32, 4, stages)
        config = SmallBatchMoeConfig(tiles, tiles, down_splits=splits)
        plain = fused_moe_triton(h, w13, w2, logits, top_k, True, config=config)
        into, _ = fused_moe_into_residual_triton(x, 1e-6, w13, w2, logits, top_k, True, residual, gamma, config)
        return plain, into

    one_step = run(1)
    for stages in (2, 3, 4):
        got = run(stages)
        assert torch.equal(got[0], one_step[0]) and torch.equal(got[1], one_step[1]), f"stages {stages}"
    assert_close(one_step[0], fused_moe_reference(h, w13, w2, logits, top_k, True), scale=2.0)


def test_split_down_pass_is_bitwise_repeatable_and_resets_its_counters(device):
    """The last split to arrive on a tile adds every split's partial in split order: the same bits whichever split
    that is (on a GPU it varies run to run), and the tile's counter back at zero for the next launch."""
    tokens, num_experts, top_k, hidden, inter = 2, 16, 8, 64, 48
    x = torch.randn(tokens, hidden, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, device)
    logits = torch.randn(tokens, num_experts, device=device)
    config = SmallBatchMoeConfig(TINY.gate_up, TINY.down, down_splits=8)
    first = fused_moe_triton(x, w13, w2, logits, top_k, True, config=config)
    for _ in range(50 if device == "cuda" else 2):
        assert torch.equal(fused_moe_triton(x, w13, w2, logits, top_k, True, config=config), first)
    assert not arrival_counters(torch.device(device), 1).any()
    assert_close(first, fused_moe_reference(x, w13, w2, logits, top_k, True))


def test_into_residual_reference_is_the_unfused_layer():
    """The reference is what the unfused decoder computes: RMSNorm, the MoE, the residual add."""
    tokens, num_experts, top_k, hidden, inter = 2, 8, 2, 32, 16
    h, residual = torch.randn(tokens, hidden) * 2, torch.randn(tokens, hidden)
    gamma, next_gamma = torch.rand(hidden) + 0.5, torch.rand(hidden) + 0.5
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, "cpu")
    logits = torch.randn(tokens, num_experts)
    eps = 1e-6
    got_h, got_next = fused_moe_into_residual_reference(
        _norm_input(h, gamma, 2), eps, w13, w2, logits, top_k, False, residual, next_gamma
    )  # fmt: skip
    normed = h * torch.rsqrt(h.pow(2).mean(dim=1, keepdim=True) + eps) * gamma
    want_h = residual + fused_moe_reference(normed, w13, w2, logits, top_k, False)
    torch.testing.assert_close(got_h, want_h)
    torch.testing.assert_close(got_next.scaled, want_h * next_gamma)
    torch.testing.assert_close(got_next.partial_sq[0], want_h.pow(2).sum(dim=1))
