"""The small-batch MoE path (kernels/fused_moe_small_batch.py: per-pair matrix-vector products, routing folded in, no
sort) against the grouped path with its tuned tiles, on a model's expert shape at decode token counts. Both are timed
as CUDA graphs (as the engine runs them), routing included, every weight copy in turn so L2 never holds a layer.

    python benchmarks/kernels/sweep_moe_small_batch.py --shape qwen3-30b-a3b [--tokens 1 2 4 8] [--from-tuned]
        [--out DIR] [--weight-dtype fp8] [--row-gemv]

Per token count: the grouped path, the small-batch default config (with --from-tuned the table's entry for the
count, where it has one), then a coordinate descent over the small-batch config (gate/up load stages, then its tiles
at those stages; the same for the down pass; the down pass's splits, with the down tiles again for a split; routing
in a top-k launch of its own instead of folded into gate/up), one line each with us/call and the achieved bandwidth
(bytes of the distinct experts the tokens chose, over the time). A config whose pipeline buffers do not fit in
shared memory is reported and skipped. The op is timed in its unfused form (no norm scaling, no residual add), as
`fused_moe` runs it; whether a token count fuses into the decoder layer (`fuse_into_layer`) is measured by
profile_steps.py with TIDAL_MOE_FUSED_LAYER=0/1, and a --from-tuned entry keeps its table's value. Ends with the
best per token count, its gain over the grouped path, and the `TUNED_SMALL_BATCH_CONFIGS` entry for
kernels/_moe_small_batch_config.py (the token counts where the small-batch path wins, from 1 up). --out writes the
figures as JSON. About 100 configs per token count: the first count compiles each (a few minutes); later counts
reuse the compiled kernels. --row-gemv sweeps narrow tiles (1-8 outputs a program, long K steps) instead of the
usual grids, from routing in a launch of its own: the shape that keeps enough programs in flight at one token
(probe_row_gemv.py), where each of thousands of programs would otherwise redo its token's top-k (folded in, the
narrow tiles took 27-75 us against 22 for the tuned entry: moe-small-batch-sweep-qwen3-30b-a3b-fp8-row-gemv-h200.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from common import gpu_tag, graph_ms, relative_error
from sweep_moe import SHAPES, ExpertCopy, expert_weight_copies
from triton.runtime.errors import OutOfResources

from tidal.kernels._moe_config import tuned_moe_config
from tidal.kernels._moe_small_batch_config import (
    GemvTiles,
    SmallBatchMoeConfig,
    default_small_batch_config,
    small_batch_moe_config,
)
from tidal.kernels.fused_moe import fused_moe_triton

GATE_UP_TILES = [GemvTiles(n, k, w) for n in (8, 16, 32, 64) for k in (128, 256, 512) for w in (4, 8)]
# The down pass loads its pairs' tiles side by side ([pairs, n, k] a step), so its K steps are shorter.
DOWN_TILES = [GemvTiles(n, k, w) for n in (8, 16, 32, 64) for k in (32, 64, 128, 256) for w in (4, 8)]
# e4m3 experts load half the bytes a step: their grids add the twice-as-long K steps.
FP8_GATE_UP_TILES = [*GATE_UP_TILES, *(GemvTiles(n, 1024, w) for n in (8, 16, 32) for w in (4, 8))]
FP8_DOWN_TILES = [*DOWN_TILES, *(GemvTiles(n, 512, w) for n in (8, 16, 32) for w in (4, 8))]
# --row-gemv: the row GEMV's shape (probe_row_gemv.py, step_floor.py): a program owns a few whole output rows of one
# pair's expert and streams them in long K steps, so one token launches thousands of programs, not a couple of
# hundred. At most 64 fp32 products a thread per step: gate/up loads two [n, k] tiles, the down pass [pairs, n, k].
ROW_GEMV_GATE_UP_TILES = [
    GemvTiles(n, k, w) for n in (1, 2, 4, 8) for k in (1024, 2048) for w in (4, 8) if 2 * n * k <= 64 * 32 * w
]
ROW_GEMV_DOWN_TILES = [GemvTiles(n, k, w) for n in (1, 2, 4) for k in (256, 512, 1024) for w in (4, 8)]
# Software-pipeline depths of the K loops (GemvTiles.stages): 1 is the unpipelined loop.
STAGES = (1, 2, 3, 4, 6)
H200_TBS = 4.8  # the H200's nominal HBM3e bandwidth; the copy ceiling measured by bench_kernels is ~4.3


def describe(config: SmallBatchMoeConfig) -> str:
    g, d = config.gate_up, config.down
    gate_up = f"gu(n{g.block_n} k{g.block_k} w{g.num_warps} st{g.stages})"
    routing = "" if config.fold_routing else " topk-launch"
    return f"{gate_up} dn(n{d.block_n} k{d.block_k} w{d.num_warps} st{d.stages}) s{config.down_splits}{routing}"


def literal(config: SmallBatchMoeConfig) -> str:
    g, d = config.gate_up, config.down
    return (
        f"SmallBatchMoeConfig(GemvTiles({g.block_n}, {g.block_k}, {g.num_warps}, {g.stages}), "
        f"GemvTiles({d.block_n}, {d.block_k}, {d.num_warps}, {d.stages}), down_splits={config.down_splits}"
        + ("" if config.fold_routing else ", fold_routing=False")
        # Not swept here (the decoder's A/B decides it), but carried from a --from-tuned start so the printed entry
        # keeps the table's choice.
        + ("" if config.fuse_into_layer else ", fuse_into_layer=False")
        + ")"
    )


def sweep_tokens(
    tokens: int, shape: tuple[int, int, int, int], weights: list[ExpertCopy], from_tuned: bool, row_gemv: bool
):
    experts, top_k, hidden, inter = shape
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    distinct = int(logits.topk(top_k, dim=-1).indices.unique().numel())
    w13, w2, scales = weights[0]
    fp8 = scales is not None
    gate_up_tiles, down_tiles = (FP8_GATE_UP_TILES, FP8_DOWN_TILES) if fp8 else (GATE_UP_TILES, DOWN_TILES)
    if row_gemv:
        gate_up_tiles, down_tiles = ROW_GEMV_GATE_UP_TILES, ROW_GEMV_DOWN_TILES
    expert_bytes = distinct * 3 * hidden * inter * w13.element_size()

    def timed(config) -> float:  # a MoeConfig (grouped) or a SmallBatchMoeConfig
        def run() -> None:
            for copy in weights:
                fused_moe_triton(x, copy.w13, copy.w2, logits, top_k, True, config, copy.scales)

        run()
        return graph_ms(run) / len(weights)

    def report(name: str, ms: float) -> None:
        tbs = expert_bytes / (ms * 1e-3) / 1e12
        print(f"T{tokens:<3} {name:<58} {ms * 1e3:8.2f} us {tbs:6.2f} TB/s", flush=True)

    grouped_config = tuned_moe_config(tokens, top_k, experts, hidden, inter, fp8_experts=fp8)
    grouped_ms = timed(grouped_config)
    report("grouped (tuned tiles)", grouped_ms)
    want = fused_moe_triton(x, w13, w2, logits, top_k, True, grouped_config, scales)
    results: dict[str, tuple[SmallBatchMoeConfig, float]] = {}

    tried: set[str] = set()

    def try_config(config: SmallBatchMoeConfig) -> None:
        key = describe(config)
        if key in tried:
            return
        tried.add(key)
        try:
            results[key] = (config, timed(config))
        except OutOfResources as error:  # pipeline buffers past shared memory
            print(f"T{tokens:<3} {key:<58} skipped: {error}", flush=True)
            return
        report(key, results[key][1])

    def best_of(candidates: Iterable[SmallBatchMoeConfig]) -> SmallBatchMoeConfig:
        """Times each candidate not tried yet; -> the fastest config so far."""
        for config in candidates:
            try_config(config)
        return min(results.values(), key=lambda r: r[1])[0]

    tuned = small_batch_moe_config(tokens, top_k, experts, hidden, inter, fp8) if from_tuned else None
    start = best = tuned or default_small_batch_config(top_k)
    if row_gemv:  # thousands of programs: each would redo its token's top-k if routing were folded into gate/up
        start = best = replace(best, fold_routing=False)
    try_config(best)
    err = relative_error(fused_moe_triton(x, w13, w2, logits, top_k, True, best, scales), want)
    print(f"T{tokens:<3} small-batch vs grouped output: relative error {err:.2e}", flush=True)
    # The row GEMV's K loop is one or two steps, so its pipeline depth hardly matters: its sweep keeps the start's.
    stages = () if row_gemv else STAGES
    best = best_of(replace(best, gate_up=replace(best.gate_up, stages=s)) for s in stages)
    best = best_of(replace(best, gate_up=replace(t, stages=best.gate_up.stages)) for t in gate_up_tiles)
    best = best_of(replace(best, down=replace(best.down, stages=s)) for s in stages)
    best = best_of(replace(best, down=replace(t, stages=best.down.stages)) for t in down_tiles)
    best = best_of(replace(best, down_splits=s) for s in (1, 2, 4, 8) if top_k % s == 0)
    if best.down_splits > 1:  # fewer pairs side by side: the down tiles again
        best = best_of(replace(best, down=replace(t, stages=best.down.stages)) for t in down_tiles)
    best = best_of([replace(best, fold_routing=not best.fold_routing)])  # a top-k launch of its own instead
    best_ms = results[describe(best)][1]
    err = max(err, relative_error(fused_moe_triton(x, w13, w2, logits, top_k, True, best, scales), want))
    tbs = expert_bytes / (best_ms * 1e-3) / 1e12
    print(
        f"T{tokens:<3} BEST {describe(best)}: {best_ms * 1e3:.2f} us ({tbs:.2f} TB/s, {tbs / H200_TBS:.0%} of "
        f"{H200_TBS}), grouped {grouped_ms * 1e3:.2f} us ({grouped_ms / best_ms:.2f}x); relative error vs grouped "
        f"at most {err:.1e}",
        flush=True,
    )
    return {
        "tokens": tokens,
        "distinct_experts": distinct,
        "expert_bytes": expert_bytes,
        "grouped_ms": grouped_ms,
        "best": asdict(best),
        "best_literal": literal(best),
        "best_ms": best_ms,
        "start": "tuned" if tuned else "default",
        "start_ms": results[describe(start)][1],
        "relative_error_vs_grouped": err,
    }


def table_entry(shape: tuple[int, int, int, int], rows: list[dict]) -> str:
    """The config table's entry: the best config of each token count from the smallest up, while it beats grouped."""
    lines = [f"    {shape}: ("]
    for row in sorted(rows, key=lambda r: r["tokens"]):
        if row["best_ms"] >= row["grouped_ms"]:
            break
        lines.append(f"        ({row['tokens']}, {row['best_literal']}),")
    return "\n".join([*lines, "    ),"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--from-tuned", action="store_true", help="start at the table's config for each count")
    parser.add_argument("--weight-dtype", choices=["auto", "fp8"], default="auto", help="fp8: e4m3 experts")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--row-gemv", action="store_true", help="sweep the row GEMV's narrow tiles instead")
    args = parser.parse_args()
    os.environ.pop("TIDAL_MOE_SMALL_BATCH", None)  # each call passes its config; the switch must not interfere
    shape = SHAPES[args.shape]
    weights = expert_weight_copies(args.shape, shape, args.weight_dtype)
    rows = [sweep_tokens(t, shape, weights, args.from_tuned, args.row_gemv) for t in sorted(args.tokens)]
    table = "TUNED_FP8_SMALL_BATCH_CONFIGS" if args.weight_dtype == "fp8" else "TUNED_SMALL_BATCH_CONFIGS"
    print(f"\n{table} entry (kernels/_moe_small_batch_config.py):")
    print(table_entry(shape, rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        fp8 = "-fp8" if args.weight_dtype == "fp8" else ""
        path = args.out / f"moe-small-batch-sweep-{args.shape}{fp8}-{gpu_tag()}.json"
        path.write_text(
            json.dumps({"shape": args.shape, "dims": shape, "weight_dtype": args.weight_dtype, "rows": rows}, indent=1)
            + "\n"
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
