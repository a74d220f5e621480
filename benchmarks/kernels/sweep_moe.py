"""Tile sweep of the fused MoE (routing, alignment, both grouped GEMMs, combine) on a model's expert shape, per token
count: the default config of kernels/_moe_config.py against candidates, found by coordinate descent (the gate/up
tiles with the down tiles fixed, then the down tiles with the best gate/up), for each M block size that suits the
token count. Decode token counts are timed as CUDA graphs (as the engine runs them), prefill counts plainly.

    python benchmarks/kernels/sweep_moe.py --shape qwen3-30b-a3b [--tokens 1 8 64 256 2048 8192] [--out DIR]
        [--weight-dtype fp8] [--block-m 16 32] [--swap-ab also|never|only]

Decode token counts also try every tile swapped (`GemmTiles.swap_ab`: W @ rows^T in the K loop) unless
--swap-ab never; the config the engine uses now (`tuned_moe_config`) is timed beside the default.

Prints one line per config and the best per token count with its gain over the default; --out writes the JSON the
config table in kernels/_moe_config.py is read from (benchmarks/results/moe-sweep-<shape>[-fp8]-<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from common import bench_ms, gpu_tag, graph_ms

from tidal.kernels._moe_config import (
    MAX_SHARED_MEMORY_BYTES,
    GemmTiles,
    MoeConfig,
    default_moe_config,
    tuned_moe_config,
)
from tidal.kernels._moe_config import shared_memory_bytes as smem
from tidal.kernels.fp8_linear import quantize_rows
from tidal.kernels.fused_moe import fused_moe_triton
from tidal.kernels.moe_expert_scales import ExpertScales

# (experts, top-k, hidden, expert intermediate) of the models the benchmark presets name.
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
GRAPHED_UP_TO = 256  # the engine's largest decode graph
TILES = [
    GemmTiles(32, 128, 4, 4),
    GemmTiles(64, 128, 4, 4),
    GemmTiles(32, 256, 4, 4),
    GemmTiles(64, 64, 4, 4),
    GemmTiles(128, 64, 4, 4),
    GemmTiles(64, 128, 4, 3),
    GemmTiles(128, 64, 8, 4),
    GemmTiles(128, 128, 8, 3),
    GemmTiles(256, 64, 8, 3),
    # Deeper pipelines and longer K steps, for weight-streaming batches (a few rows per expert).
    GemmTiles(64, 256, 4, 3),
    GemmTiles(64, 128, 4, 5),
    GemmTiles(128, 128, 4, 4),
    GemmTiles(64, 128, 8, 3),
]


def block_ms_for(tokens: int) -> list[int]:
    if tokens <= 16:
        return [16]
    if tokens <= GRAPHED_UP_TO:
        return [16, 32, 64]
    return [64, 128]


def describe(c: MoeConfig) -> str:
    def tiles(t: GemmTiles) -> str:
        return f"n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}{' swap' if t.swap_ab else ''}"

    return f"m{c.block_m} gu({tiles(c.gate_up)}) dn({tiles(c.down)})"


def candidate_tiles(tokens: int, swap_ab: str) -> list[GemmTiles]:
    """TILES, swapped too for decode token counts (a few rows per expert, where swapping can pay)."""
    plain = [] if swap_ab == "only" else list(TILES)
    if swap_ab == "never" or tokens > GRAPHED_UP_TO:
        return plain
    return plain + [replace(t, swap_ab=True) for t in TILES]


def fits(config: MoeConfig) -> bool:
    return all(smem(config.block_m, t, 2) <= MAX_SHARED_MEMORY_BYTES for t in (config.gate_up, config.down))


def sweep_tokens(
    tokens: int,
    shape: tuple[int, int, int, int],
    weights: list[ExpertCopy],
    block_ms: list[int] | None = None,
    swap_ab: str = "also",
):
    experts, top_k, hidden, inter = shape
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")

    def timed(config: MoeConfig) -> float:
        def run() -> None:  # every weight copy in turn, so L2 never holds a layer's experts, as in a real forward
            for w13, w2, scales in weights:
                fused_moe_triton(x, w13, w2, logits, top_k, True, config, scales)

        run()
        ms = graph_ms(run) if tokens <= GRAPHED_UP_TO else bench_ms(run, rep_ms=100)
        return ms / len(weights)

    default = default_moe_config(tokens, top_k, experts)
    results = {describe(default): (default, timed(default))}
    print(f"T{tokens:<6} default {describe(default):<50} {results[describe(default)][1] * 1e3:9.1f} us", flush=True)
    in_use = tuned_moe_config(tokens, top_k, experts, hidden, inter, fp8_experts=weights[0].scales is not None)
    if describe(in_use) not in results:  # the default may be the config in use
        results[describe(in_use)] = (in_use, timed(in_use))
    in_use_ms = results[describe(in_use)][1]
    print(f"T{tokens:<6} in use  {describe(in_use):<50} {in_use_ms * 1e3:9.1f} us", flush=True)
    for block_m in block_ms or block_ms_for(tokens):
        best = MoeConfig(block_m, default.gate_up, default.down)
        for side in ("gate_up", "down"):
            for tiles in candidate_tiles(tokens, swap_ab):
                config = (
                    MoeConfig(block_m, tiles, best.down)
                    if side == "gate_up"
                    else MoeConfig(block_m, best.gate_up, tiles)
                )
                key = describe(config)
                if key in results or not fits(config):
                    continue
                try:
                    results[key] = (config, timed(config))
                except triton.runtime.errors.OutOfResources as err:  # the gate/up pass keeps two B tiles per stage
                    print(f"T{tokens:<6} {key:<58} skipped: {err}", flush=True)
                    continue
                print(f"T{tokens:<6} {key:<58} {results[key][1] * 1e3:9.1f} us", flush=True)
            best = min((r for r in results.values() if r[0].block_m == block_m), key=lambda r: r[1])[0]
    winner, ms = min(results.values(), key=lambda r: r[1])
    base = results[describe(default)][1]
    print(
        f"T{tokens:<6} BEST {describe(winner)}: {ms * 1e3:.1f} us, default {base * 1e3:.1f} us ({base / ms:.2f}x), "
        f"in use {in_use_ms * 1e3:.1f} us ({in_use_ms / ms:.2f}x)"
    )
    return {
        "tokens": tokens,
        "best": asdict(winner),
        "best_ms": ms,
        "default": asdict(default),
        "default_ms": base,
        "in_use": asdict(in_use),
        "in_use_ms": in_use_ms,
    }


class ExpertCopy(NamedTuple):
    """One copy of a layer's experts as the kernels take them: bf16 stacks and no scales, or FP8 ones with theirs."""

    w13: torch.Tensor
    w2: torch.Tensor
    scales: ExpertScales | None


def _fp8(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_rows(stack.view(-1, stack.shape[-1]))
    return q.view(stack.shape), scale.view(stack.shape[:2])


def expert_weight_copies(name: str, shape: tuple[int, int, int, int], weight_dtype: str = "auto") -> list[ExpertCopy]:
    """Copies of one layer's random experts (bf16, or with `weight_dtype` "fp8" e4m3 with per-channel scales), ~4 GB
    in all at bf16's size, so a timed loop over them never finds a layer in L2; prints what it made."""
    experts, top_k, hidden, inter = shape
    layer_bytes = experts * 3 * hidden * inter * 2
    copies = max(2, min(8, int(4e9 // layer_bytes)))
    print(f"{name}: E{experts} top{top_k} H{hidden} I{inter} {weight_dtype}, {copies} weight copies", flush=True)
    out = []
    for _ in range(copies):
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
        if weight_dtype == "fp8":
            (q13, s13), (q2, s2) = _fp8(w13), _fp8(w2)
            out.append(ExpertCopy(q13, q2, ExpertScales(s13, s2)))
        else:
            out.append(ExpertCopy(w13, w2, None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    parser.add_argument("--weight-dtype", choices=["auto", "fp8"], default="auto", help="fp8: e4m3 experts")
    parser.add_argument("--block-m", type=int, nargs="+", default=None, help="only these M blocks (default: by count)")
    parser.add_argument("--swap-ab", choices=["also", "never", "only"], default="also", help="swapped tiles (decode)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    weights = expert_weight_copies(args.shape, shape, args.weight_dtype)
    rows = [sweep_tokens(t, shape, weights, args.block_m, args.swap_ab) for t in args.tokens]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        fp8 = "-fp8" if args.weight_dtype == "fp8" else ""
        path = args.out / f"moe-sweep-{args.shape}{fp8}-{gpu_tag()}.json"
        path.write_text(json.dumps({"shape": args.shape, "dims": shape, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
