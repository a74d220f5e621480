"""When the MoE takes the small-batch path (per-pair matrix-vector products, no sort by expert) and with which tiles
(pure, no torch). The choice depends on static shapes only (the token count, the expert shape), so a CUDA graph
captured for one batch size always runs one path."""

import math
from dataclasses import dataclass

# Pairs (tokens x top-k) up to which an expert shape the sweep has not measured takes the small-batch path. Each pair
# reads its expert's weights on its own (repeats across tokens only share what L2 keeps), while the grouped GEMMs read
# each chosen expert once but first sort the pairs (three launches); at a few pairs the sort costs more.
DEFAULT_MAX_PAIRS = 16
# ... and only for experts at most this wide. The down pass gives each (token, H-tile) one program that streams the
# whole expert width, so wide experts leave few programs with long serial streams: on an H200 Mixtral-8x7B's
# (width 14336) decode step at one token took 11.0 ms on the default small-batch tiles against 7.58 on the grouped
# GEMMs (moe-perf-h200.md), while Qwen3-30B-A3B's (768) gained. Until a sweep tunes a wide shape, it stays grouped.
DEFAULT_MAX_EXPERT_WIDTH = 2048


@dataclass(frozen=True)
class GemvTiles:
    block_n: int  # output columns per program
    block_k: int  # input elements per load of each weight row: wide, vectorised loads along K
    num_warps: int
    # Software-pipeline depth of the K loop. With > 1 Triton loads `stages - 1` K steps ahead into shared memory
    # (cp.async), so a program keeps streaming while it multiplies; with 1 each step's loads wait for the previous
    # step's products. These kernels reduce with sums, not tl.dot, and Triton pipelines such a loop only when the loop
    # itself asks for stages (tl.range's num_stages), never from the launch's num_stages; and only loads of 4 or more
    # aligned contiguous bytes, so K must be a multiple of 16 at launch (every model's is).
    stages: int = 1


@dataclass(frozen=True)
class SmallBatchMoeConfig:
    gate_up: GemvTiles
    down: GemvTiles
    # Programs per token over its top-k pairs in the down pass, each loading its top_k / down_splits pairs' tiles side
    # by side ([pairs, block_n, block_k] a step); with > 1 the last split of each output tile adds the partials.
    down_splits: int = 1
    # Route in the gate/up kernel (every program redoes its token's softmax and top-k before its first weight load:
    # a few reductions over the experts up to 128 of them, ~2k + 2 beyond) rather than in a top-k launch of its own.
    fold_routing: bool = True
    # Whether a decoder layer with these experts joins the small-batch decoder path at this token count (its norms
    # folded into the small-batch projections around the experts, SparseMoE.forward_small_batch) or runs unfused
    # (cuBLAS projections and RMSNorm launches) around the same expert kernels: which is faster depends on how well
    # the small-batch projections serve the model's attention shapes at this count.
    fuse_into_layer: bool = True


# Elements of W2 a down-pass program loads per step of its K loop (its pairs x BLOCK_N x BLOCK_K): 16 KB of bf16,
# 128 bytes a thread at four warps, as the gate/up default's two 16 x 256 tiles.
DOWN_TILE_ELEMENTS = 8192


def default_small_batch_config(top_k: int) -> SmallBatchMoeConfig:
    """Tiles for a shape the sweep has not measured: 16 outputs a program (many programs at one token), and a down
    pass whose K step shrinks as more pairs load side by side."""
    pairs = _next_power_of_2(top_k)
    down_k = min(256, max(32, DOWN_TILE_ELEMENTS // (16 * pairs)))
    return SmallBatchMoeConfig(gate_up=GemvTiles(16, 256, 4), down=GemvTiles(16, down_k, 4))


# Measured best per expert shape, bf16, on an H200 (benchmarks/kernels/sweep_moe_small_batch.py prints these
# entries): (experts, top-k, hidden, expert intermediate) -> (up to this many tokens, config) in increasing token
# order; a count above the last entry takes the grouped GEMMs. A shape not listed takes the default config up to
# DEFAULT_MAX_PAIRS pairs if its experts are at most DEFAULT_MAX_EXPERT_WIDTH wide.
# From benchmarks/kernels/sweep_moe_small_batch.py on an H200 (moe-small-batch-sweep-qwen3-30b-a3b-h200.json): the MoE
# op at 1/2/4/8 tokens took 31.8/47.8/81.9/136.7 us against the grouped path's 43.4/59.5/94.2/147.5 us. The layer
# fusion from profile_steps.py with TIDAL_MOE_FUSED_LAYER=0/1 (moe-perf-h200.md): a decode step at 1/2/4/8 tokens took
# 3287/4305/6543/8877 us fused against 3336/4614/6242/8691 unfused, so 4 and 8 tokens stay unfused. The 1- and
# 2-token entries were swept again from these ones with load stages and the down pass's splits summed in the kernel
# (`--from-tuned --tokens 1 2`, moe-small-batch-sweep-qwen3-30b-a3b-h200-stages.txt): at 1 token a four-stage gate/up
# pipeline and wider tiles took 31.4 us against 33.9 for the old entry in the same run; at 2 tokens every pipelined
# variant was slower (46.0 us for the entry, 46.5-58.8 pipelined), the best found (45.9) is within noise of it, and
# the entry stays.
TUNED_SMALL_BATCH_CONFIGS: dict[tuple[int, int, int, int], tuple[tuple[int, SmallBatchMoeConfig], ...]] = {
    (128, 8, 2048, 768): (
        (1, SmallBatchMoeConfig(GemvTiles(32, 256, 4, stages=4), GemvTiles(32, 256, 8), down_splits=8)),
        (2, SmallBatchMoeConfig(GemvTiles(16, 128, 8), GemvTiles(32, 256, 8), down_splits=8)),
        (4, SmallBatchMoeConfig(GemvTiles(32, 128, 8), GemvTiles(32, 128, 8), down_splits=1, fuse_into_layer=False)),
        (
            8,
            SmallBatchMoeConfig(
                GemvTiles(64, 256, 8), GemvTiles(32, 128, 8), down_splits=1, fold_routing=False, fuse_into_layer=False
            ),
        ),
    ),
}


# The same for e4m3 experts (FP8 weights widened in registers), for the token counts swept on them; a count past a
# shape's FP8 entries takes its 16-bit entry (whose tiles then load half the bytes a step), so the 16-bit table still
# decides where the grouped GEMMs take over. Qwen3-30B-A3B at one token on an H100 (sweep_moe_small_batch.py
# --weight-dtype fp8 --tokens 1 --from-tuned; moe-small-batch-sweep-qwen3-30b-a3b-fp8-h100.json): 25.73 us against
# 27.10 for the 16-bit entry and 43.01 for the grouped GEMMs; three gate/up stages, the down pass 8 outputs a program.
TUNED_FP8_SMALL_BATCH_CONFIGS: dict[tuple[int, int, int, int], tuple[tuple[int, SmallBatchMoeConfig], ...]] = {
    (128, 8, 2048, 768): ((1, SmallBatchMoeConfig(GemvTiles(32, 256, 4, 3), GemvTiles(8, 256, 4, 1), down_splits=8)),),
}


def small_batch_moe_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, fp8_experts: bool = False
) -> SmallBatchMoeConfig | None:
    """The small-batch config for this batch and expert shape, or None where the grouped GEMMs should run."""
    if num_tokens < 1:
        return None
    dims = (num_experts, top_k, hidden, inter)
    if fp8_experts:
        tuned = _entry(TUNED_FP8_SMALL_BATCH_CONFIGS.get(dims, ()), num_tokens)
        if tuned is not None:
            return tuned
    table = TUNED_SMALL_BATCH_CONFIGS.get(dims)
    if table is not None:
        return _entry(table, num_tokens)
    if inter > DEFAULT_MAX_EXPERT_WIDTH or num_tokens * top_k > DEFAULT_MAX_PAIRS:
        return None
    return default_small_batch_config(top_k)


def _entry(table: tuple[tuple[int, SmallBatchMoeConfig], ...], num_tokens: int) -> SmallBatchMoeConfig | None:
    """The first entry of a table (ascending token counts) that covers num_tokens; None past its last."""
    return next((config for up_to, config in table if num_tokens <= up_to), None)


def fit_tiles(tiles: GemvTiles, n: int, k: int) -> GemvTiles:
    """`tiles` narrowed to a small problem: no wider than the next power of two of N and K (at least 16)."""
    return GemvTiles(min(tiles.block_n, max(16, _next_power_of_2(n))), min(tiles.block_k, max(16, _next_power_of_2(k))),
                     tiles.num_warps, tiles.stages)  # fmt: skip


def down_splits(config: SmallBatchMoeConfig, top_k: int) -> int:
    """The config's splits of a token's pairs, lowered to divide top-k (every split sums as many pairs)."""
    return math.gcd(max(config.down_splits, 1), top_k)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
