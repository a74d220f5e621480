"""FP8 experts' grouped GEMMs W8A16 (e4m3 weights widened in registers) against W8A8 (the activations' rows
quantized too, FP8 tensor cores), per token count, on a model's expert shape: what `FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT`
in kernels/_moe_config.py is to be set from.

    python benchmarks/kernels/bench_moe_fp8_activations.py [--shape qwen3-30b-a3b]
        [--tokens 64 256 512 1024 1536 2048 4096] [--out DIR]

Each line: the token count, rows per expert on average, both paths' time per layer (routing, both GEMMs and the
combine, every weight copy in turn so L2 never holds a layer; CUDA graphs up to 256 tokens as the engine runs
decode, plain launches above as it runs prefill), their ratio, and each path's relative error against the W8A16
reference. Ends with the smallest rows-per-expert count from which W8A8 won at every larger count measured: the
threshold to set (or none). --out writes the figures as JSON (moe-fp8-activations-<shape>-<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import bench_ms, gpu_tag, graph_ms, relative_error
from sweep_moe import GRAPHED_UP_TO, SHAPES, ExpertCopy, expert_weight_copies

import tidal.kernels._moe_config as moe_config
from tidal.kernels.fused_moe import fused_moe_reference, fused_moe_triton

PATHS = {"w8a16": None, "w8a8": 0}  # FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT for each: never, always


def time_tokens(tokens: int, shape: tuple[int, int, int, int], weights: list[ExpertCopy]) -> dict:
    experts, top_k, hidden, _ = shape
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    first = weights[0]
    want = fused_moe_reference(x, first.w13, first.w2, logits, top_k, True, first.scales)
    row: dict = {"tokens": tokens, "rows_per_expert": tokens * top_k / experts}
    for name, threshold in PATHS.items():
        moe_config.FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT = threshold

        def run() -> None:
            for copy in weights:
                fused_moe_triton(x, copy.w13, copy.w2, logits, top_k, True, None, copy.scales)

        run()  # compiles outside the timing
        ms = graph_ms(run) if tokens <= GRAPHED_UP_TO else bench_ms(run, rep_ms=100)
        row[f"{name}_us"] = ms / len(weights) * 1e3
        got = fused_moe_triton(x, first.w13, first.w2, logits, top_k, True, None, first.scales)
        row[f"{name}_error"] = relative_error(got, want)
    row["w8a8_speedup"] = row["w8a16_us"] / row["w8a8_us"]
    print(
        f"T{tokens:<6} {row['rows_per_expert']:7.1f} rows/expert   W8A16 {row['w8a16_us']:8.1f} us   "
        f"W8A8 {row['w8a8_us']:8.1f} us   W8A8 {row['w8a8_speedup']:.2f}x   errors {row['w8a16_error']:.1e} / "
        f"{row['w8a8_error']:.1e}",
        flush=True,
    )
    return row


def threshold_from(rows: list[dict]) -> float | None:
    """The smallest rows-per-expert count from which W8A8 won at every larger measured count, or None."""
    winning = None
    for row in sorted(rows, key=lambda r: r["rows_per_expert"], reverse=True):
        if row["w8a8_speedup"] <= 1.0:
            break
        winning = row["rows_per_expert"]
    return winning


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512, 1024, 1536, 2048, 4096])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device")
    shape = SHAPES[args.shape]
    weights = expert_weight_copies(args.shape, shape, "fp8")
    rows = [time_tokens(t, shape, weights) for t in sorted(args.tokens)]
    threshold = threshold_from(rows)
    print(f"W8A8 won from {threshold} rows per expert up" if threshold is not None else "W8A8 never won throughout")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"moe-fp8-activations-{args.shape}-{gpu_tag()}.json"
        path.write_text(json.dumps({"shape": args.shape, "dims": shape, "rows": rows, "threshold": threshold},
                                   indent=1) + "\n")  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
