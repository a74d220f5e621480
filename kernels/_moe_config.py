"""Tile shapes for the MoE grouped GEMMs, chosen from the batch size (pure, no torch)."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # W @ rows^T in the K loop (`grouped_gemm_kernel`'s SWAP_AB): the weight tile is the dot's first operand.
    swap_ab: bool = False


# Shared memory a block may use on the GPUs we tune for (H100/H200: 227 KiB); a tile set above it cannot launch.
MAX_SHARED_MEMORY_BYTES = 232448


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per M-block; both passes share it because the sorted layout is aligned to it
    gate_up: GemmTiles
    down: GemmTiles
    group_m: int = 8


def shared_memory_bytes(block_m: int, tiles: GemmTiles, element_size: int) -> int:
    """What a grouped GEMM's software pipeline keeps in shared memory: an A and a B tile per stage."""
    return tiles.num_stages * (block_m * tiles.block_k + tiles.block_k * tiles.block_n) * element_size


def default_moe_config(
    num_tokens: int, top_k: int, num_experts: int, element_size: int = 2, fp8_activations: bool = False
) -> MoeConfig:
    """Few tokens: the GEMMs only stream the chosen experts' weights, so use the smallest M tile and narrow N tiles
    (many programs in flight). Many tokens: large tiles for tensor-core throughput. `element_size`: bytes per
    weight element; 4-byte weights (fp32) get fewer pipeline stages where the tiles would not fit shared memory.
    `fp8_activations`: the W8A8 grouped GEMMs' tiles (`_w8a8_tiles_for`)."""
    config = (
        _w8a8_tiles_for(num_tokens, top_k, num_experts)
        if fp8_activations
        else _tiles_for(num_tokens, top_k, num_experts)
    )
    fitted = {}
    for name, tiles in (("gate_up", config.gate_up), ("down", config.down)):
        while (
            tiles.num_stages > 1 and shared_memory_bytes(config.block_m, tiles, element_size) > MAX_SHARED_MEMORY_BYTES
        ):
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        fitted[name] = tiles
    return MoeConfig(config.block_m, fitted["gate_up"], fitted["down"], config.group_m)


def _tiles_for(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if num_tokens <= 32:
        return MoeConfig(
            block_m=16,
            gate_up=GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4),
            down=GemmTiles(block_n=32, block_k=256, num_warps=4, num_stages=4),
        )
    if rows_per_expert < 192:
        return MoeConfig(
            block_m=64,
            gate_up=GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=4),
            down=GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=4),
        )
    # Measured best of a small sweep on an H200 (benchmarks/results/): wide N tiles for the down projection.
    return MoeConfig(
        block_m=128,
        gate_up=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4),
        down=GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3),
    )


def _w8a8_tiles_for(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Tiles for e4m3 activations and weights: the 16-bit tiles' shapes with twice the K step (an e4m3 K step of
    128 is the bytes of a 16-bit one of 64) and N at most 128. The 16-bit large tiles (128 x 256 for down, two
    128 x 128 accumulators for gate/up at 8 warps) spill registers with FP8 operands on sm_90 (ptxas, via
    benchmarks/kernels/register_report.py); these do not. Timed on an H100 (bench_moe_fp8_activations.py), not swept."""
    # (block_m; gate/up and down as (block_n, block_k, num_warps, num_stages)), as the 16-bit tiles' two tiers.
    if num_tokens * top_k / max(num_experts, 1) < 192:
        return MoeConfig(64, GemmTiles(64, 128, 4, 4), GemmTiles(128, 128, 4, 4))
    return MoeConfig(128, GemmTiles(64, 128, 8, 4), GemmTiles(128, 128, 8, 4))


# Measured best per expert shape, bf16, on an H200 (benchmarks/kernels/sweep_moe.py; the figures are in
# benchmarks/results/moe-sweep-<shape>-h200.json): (experts, top-k, hidden, expert intermediate) -> (up to this many
# tokens, config) in increasing token order. A count above the last entry takes the default tiles, which the sweep
# found best there (4096 tokens).
TUNED_MOE_CONFIGS: dict[tuple[int, int, int, int], tuple[tuple[int, MoeConfig], ...]] = {
    # Qwen3-30B-A3B: 128 experts of width 768, top-8. Narrow gate/up tiles at a few tokens (25% over the default at
    # one token), wide ones once each expert has a few rows.
    (128, 8, 2048, 768): (
        (8, MoeConfig(16, GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 3))),
        (64, MoeConfig(16, GemmTiles(128, 128, 8, 3), GemmTiles(64, 128, 4, 3))),
        (256, MoeConfig(32, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3))),
    ),
    # Mixtral-8x7B: 8 experts of width 14336, top-2. Both passes swapped (W @ rows^T) at one and at 8 tokens:
    # 180.9 us a layer against 188.6 for the default at one token (a second sweep with longer K steps,
    # moe-sweep-mixtral-8x7b-t1-h200.txt), 567.9 against 599.0 at eight (moe-sweep-mixtral-8x7b-h200.json). More
    # tokens take the default tiles, not swept since the swap.
    (8, 2, 4096, 14336): (
        (1, MoeConfig(16, GemmTiles(64, 128, 4, 3, swap_ab=True), GemmTiles(64, 256, 4, 3, swap_ab=True))),
        (8, MoeConfig(16, GemmTiles(128, 128, 8, 3, swap_ab=True), GemmTiles(64, 128, 4, 4, swap_ab=True))),
    ),
}


# e4m3 experts widened in registers (W8A16), measured on an H200 (sweep_moe.py --weight-dtype fp8 --swap-ab only;
# benchmarks/results/moe-sweep-<shape>-fp8-h200.json); a shape missing here takes the bf16 table. Up to 64 tokens the
# bf16 entries stayed best (the swapped tiles' best came within 1%); from 65 to 256 the gate/up pass swapped
# (W @ rows^T) at 16-row blocks measured 245 us a layer at 256 tokens against 265 us for the bf16 entry.
TUNED_FP8_MOE_CONFIGS: dict[tuple[int, int, int, int], tuple[tuple[int, MoeConfig], ...]] = {
    (128, 8, 2048, 768): (
        *TUNED_MOE_CONFIGS[(128, 8, 2048, 768)][:2],
        (256, MoeConfig(16, GemmTiles(64, 128, 4, 3, swap_ab=True), GemmTiles(128, 64, 4, 4))),
    ),
}


# FP8 experts quantize the activations too (W8A8, FP8 tensor cores) once the experts get this many rows each on
# average: a grouped GEMM with few rows per expert streams weights, and widening them in registers (W8A16) costs
# nothing that shows, while quantizing the rows costs accuracy (4.6e-2 relative error against 2.6e-3) and time; with
# many, the products are the work. On an H100 at Qwen3-30B-A3B's expert shape, W8A8 lost up to 64 rows per expert
# (0.81-0.96x) and won from 96 up (1.26-1.34x, 1536 to 16384 tokens), so prefill chunks of 1536 tokens and more take
# it (benchmarks/results/moe-fp8-activations-qwen3-30b-a3b-h100.md). None keeps every batch W8A16.
FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT: int | None = 96


def quantizes_activations(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether FP8 experts run this batch's grouped GEMMs W8A8 (else W8A16; see FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT)."""
    threshold = FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT
    return threshold is not None and num_tokens * top_k >= threshold * max(num_experts, 1)


def tuned_moe_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    inter: int,
    element_size: int = 2,
    fp8_experts: bool = False,
) -> MoeConfig:
    """The swept config for this expert shape and token count where there is one (16-bit activations; e4m3 experts
    widened in registers read their own table first), else the default."""
    if element_size == 2:
        dims = (num_experts, top_k, hidden, inter)
        table = TUNED_FP8_MOE_CONFIGS.get(dims) if fp8_experts else None
        for up_to, config in table or TUNED_MOE_CONFIGS.get(dims, ()):
            if num_tokens <= up_to:
                return config
    return default_moe_config(num_tokens, top_k, num_experts, element_size)
