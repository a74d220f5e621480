"""Tile shapes for the MoE grouped GEMMs, chosen from the batch size (pure, no torch)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per M-block; both passes share it because the sorted layout is aligned to it
    gate_up: GemmTiles
    down: GemmTiles
    group_m: int = 8


def default_moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Few tokens: the GEMMs only stream the chosen experts' weights, so use the smallest M tile and narrow N tiles
    (many programs in flight). Many tokens: large tiles for tensor-core throughput."""
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
