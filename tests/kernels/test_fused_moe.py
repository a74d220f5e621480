"""Fused MoE: routing, expert alignment and grouped GEMMs in Triton vs the torch reference."""

import pytest
import torch
from tolerances import DOT_DTYPES, assert_close

from tidal.kernels._moe_config import (
    MAX_SHARED_MEMORY_BYTES,
    TUNED_FP8_MOE_CONFIGS,
    TUNED_MOE_CONFIGS,
    GemmTiles,
    MoeConfig,
    default_moe_config,
    shared_memory_bytes,
    tuned_moe_config,
)
from tidal.kernels.fused_moe import (
    align_chunk,
    fused_moe,
    fused_moe_experts_reference,
    fused_moe_experts_triton,
    fused_moe_reference,
    fused_moe_triton,
    sort_pairs_by_expert,
    topk_route,
    topk_route_reference,
    topk_route_triton,
)

SMALL = MoeConfig(
    block_m=16,
    gate_up=GemmTiles(block_n=16, block_k=32, num_warps=4, num_stages=2),
    down=GemmTiles(block_n=32, block_k=16, num_warps=4, num_stages=2),
    group_m=2,
)
# The same tiles with W @ rows^T in both passes' K loops.
SWAPPED = MoeConfig(
    block_m=16,
    gate_up=GemmTiles(block_n=16, block_k=32, num_warps=4, num_stages=2, swap_ab=True),
    down=GemmTiles(block_n=32, block_k=16, num_warps=4, num_stages=2, swap_ab=True),
    group_m=2,
)


def _weights(num_experts, hidden, inter, dtype, device):
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=dtype, device=device) / inter**0.5
    return w13, w2


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 4, 1), (5, 8, 2), (37, 6, 3), (0, 4, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_route_matches_reference(device, tokens, num_experts, top_k, renormalize):
    logits = torch.randn(tokens, num_experts, device=device)
    weights, ids = topk_route_triton(logits, top_k, renormalize)
    want_weights, want_ids = topk_route_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 64, 32), (7, 8, 2, 48, 40), (45, 6, 3, 64, 24), (0, 4, 1, 32, 16), (50, 130, 3, 32, 16)],
)
@pytest.mark.parametrize("config", [SMALL, SWAPPED], ids=["plain", "swapped"])
def test_fused_moe_matches_reference(device, dtype, tokens, num_experts, top_k, hidden, inter, config):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    logits = torch.randn(tokens, num_experts, device=device)
    got = fused_moe_triton(x, w13, w2, logits, top_k, True, config=config)
    assert_close(got, fused_moe_reference(x, w13, w2, logits, top_k, True), scale=2.0)


def test_experts_with_skewed_routing_and_unused_experts(device):
    """Every token on one expert (segments of many blocks) and most experts unused (empty segments)."""
    tokens, num_experts, hidden, inter = 40, 5, 32, 32
    x = torch.randn(tokens, hidden, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, device)
    ids = torch.stack([torch.full((tokens,), 3), torch.randint(0, 2, (tokens,))], dim=1).int().to(device)
    weights = torch.rand(tokens, 2, device=device)
    got = fused_moe_experts_triton(x, w13, w2, weights, ids, config=SMALL)
    assert_close(got, fused_moe_experts_reference(x, w13, w2, weights, ids))


def test_default_configs_cover_decode_and_prefill(device, monkeypatch):
    monkeypatch.setenv("TIDAL_MOE_SMALL_BATCH", "0")  # the grouped GEMMs' default tiles at a decode-sized batch
    tokens, num_experts, hidden, inter = 3, 4, 64, 64
    x = torch.randn(tokens, hidden, dtype=torch.float16, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float16, device)
    logits = torch.randn(tokens, num_experts, device=device)
    assert_close(fused_moe_triton(x, w13, w2, logits, 2, False), fused_moe_reference(x, w13, w2, logits, 2, False))
    assert default_moe_config(8192, 2, 8).block_m == 128
    assert default_moe_config(1, 2, 8).block_m == 16


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_every_default_tile_set_fits_shared_memory(num_tokens, element_size):
    # fp32 weights with the large tiles once asked for 288 KiB (found on an H200 by the expert-parallel warm-up).
    config = default_moe_config(num_tokens, 2, 8, element_size)
    for tiles in (config.gate_up, config.down):
        assert shared_memory_bytes(config.block_m, tiles, element_size) <= MAX_SHARED_MEMORY_BYTES
    assert default_moe_config(num_tokens, 2, 8, 2) == default_moe_config(num_tokens, 2, 8)  # bf16: as tuned


def test_tuned_configs_apply_to_their_shape_in_bf16_only():
    qwen3 = (128, 8, 2048, 768)
    table = TUNED_MOE_CONFIGS[qwen3]
    assert tuned_moe_config(1, 8, 128, 2048, 768) == table[0][1]
    assert tuned_moe_config(9, 8, 128, 2048, 768) == table[1][1]  # the next measured count up
    assert tuned_moe_config(256, 8, 128, 2048, 768) == table[-1][1]
    assert tuned_moe_config(257, 8, 128, 2048, 768) == default_moe_config(257, 8, 128)  # past the table
    assert tuned_moe_config(1, 8, 128, 2048, 768, element_size=4) == default_moe_config(1, 8, 128, 4)
    assert tuned_moe_config(1, 8, 64, 2048, 768) == default_moe_config(1, 8, 64)  # a shape not swept
    mixtral = TUNED_MOE_CONFIGS[(8, 2, 4096, 14336)]
    assert tuned_moe_config(1, 2, 8, 4096, 14336) == mixtral[0][1]
    assert tuned_moe_config(9, 2, 8, 4096, 14336) == default_moe_config(9, 2, 8)  # past its table
    for entries in (*TUNED_MOE_CONFIGS.values(), *TUNED_FP8_MOE_CONFIGS.values()):
        assert [up_to for up_to, _ in entries] == sorted(up_to for up_to, _ in entries)


def test_fp8_experts_read_their_own_table_first():
    qwen3 = (128, 8, 2048, 768)
    fp8 = TUNED_FP8_MOE_CONFIGS[qwen3]
    assert tuned_moe_config(256, 8, 128, 2048, 768, fp8_experts=True) == fp8[-1][1]
    assert fp8[-1][1].gate_up.swap_ab and not TUNED_MOE_CONFIGS[qwen3][-1][1].gate_up.swap_ab
    assert tuned_moe_config(100, 8, 128, 2048, 768, fp8_experts=True) == fp8[-1][1]
    assert tuned_moe_config(64, 8, 128, 2048, 768, fp8_experts=True) == TUNED_MOE_CONFIGS[qwen3][1][1]
    # A shape without an FP8 entry takes the bf16 table; past the FP8 table, the default.
    assert tuned_moe_config(1, 2, 8, 4096, 14336, fp8_experts=True) == tuned_moe_config(1, 2, 8, 4096, 14336)
    assert tuned_moe_config(257, 8, 128, 2048, 768, fp8_experts=True) == default_moe_config(257, 8, 128)


def test_every_tuned_tile_set_fits_shared_memory():
    for entries in (*TUNED_MOE_CONFIGS.values(), *TUNED_FP8_MOE_CONFIGS.values()):
        for _, config in entries:
            for tiles in (config.gate_up, config.down):
                assert shared_memory_bytes(config.block_m, tiles, 2) <= MAX_SHARED_MEMORY_BYTES


def test_alignment_chunks_cover_small_and_large_batches():
    assert align_chunk(8, 128) == 16  # batch 1, top-8: one program
    assert align_chunk(2048, 128) == 32  # batch 256: 64 programs of a [32, 128] one-hot
    assert align_chunk(2048, 8) == 512


@pytest.mark.parametrize(("tokens", "top_k", "num_experts"), [(70, 8, 128), (300, 2, 8)])
def test_alignment_across_many_chunks_matches_reference(device, tokens, top_k, num_experts):
    """Pairs spread over several alignment programs (chunks), and padding beyond one fill pass."""
    hidden, inter = 32, 16
    x = torch.randn(tokens, hidden, device=device)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, device)
    logits = torch.randn(tokens, num_experts, device=device)
    weights, ids = topk_route_reference(logits, top_k, True)
    got = fused_moe_experts_triton(x, w13, w2, weights, ids.to(device), config=SMALL)
    assert_close(got, fused_moe_experts_reference(x, w13, w2, weights, ids))


def reference_layout(ids: list[int], num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(sorted rows, expert of each M-block): each expert's pairs in their order, padded with the sentinel N."""
    rows: list[int] = []
    block_expert: list[int] = []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(ids) if e == expert]
        padded = -(-len(pairs) // block_m) * block_m
        rows += pairs + [len(ids)] * (padded - len(pairs))
        block_expert += [expert] * (padded // block_m)
    return rows, block_expert


# Chunks of 32 pairs for 128 experts, read 32 chunks at a time by the layout program: 75 chunks take three reads
# (the last partial), 50 two; 8 experts take chunks of up to 512 pairs.
@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m"),
    [(1, 8, 128, 16), (300, 8, 128, 16), (200, 8, 128, 32), (64, 8, 128, 64), (3000, 2, 8, 16), (5, 2, 8, 16)],
)
def test_the_sort_matches_a_reference_layout(device, tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    # Skewed: a few experts take most pairs, some none, so segments differ in length and padding.
    weights = torch.rand(num_experts, generator=gen) ** 4
    ids = torch.stack([torch.multinomial(weights, top_k, generator=gen) for _ in range(tokens)]).int()
    sorted_pairs, block_expert, pair_row, max_blocks = sort_pairs_by_expert(ids.to(device), num_experts, block_m)
    want_rows, want_blocks = reference_layout(ids.flatten().tolist(), num_experts, block_m)
    assert sorted_pairs[: len(want_rows)].tolist() == want_rows
    assert block_expert.tolist() == want_blocks + [-1] * (max_blocks - len(want_blocks))
    assert all(want_rows[row] == pair for pair, row in enumerate(pair_row.tolist()))


def test_dispatch_and_validation_on_cpu():
    x = torch.randn(3, 16)
    w13, w2 = _weights(4, 16, 8, torch.float32, "cpu")
    logits = torch.randn(3, 4)
    assert torch.equal(fused_moe(x, w13, w2, logits, 2, True), fused_moe_reference(x, w13, w2, logits, 2, True))
    assert torch.equal(topk_route(logits, 2, False)[1], topk_route_reference(logits, 2, False)[1])
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, logits, 5, True)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :4], logits, 2, True)
