"""Runs every kernel benchmark on the current CUDA device, prints a markdown table and writes kernels.json and
kernels.md (default: benchmarks/results/). Usage: python benchmarks/kernels/run_all.py [--out DIR] [--quick]."""

import argparse
import pathlib
import platform
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bench_attention
import bench_elementwise
import bench_moe
from common import format_table, measure_ceilings, to_json

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="defaults only, no tile sweeps")
    parser.add_argument("--only", choices=["elementwise", "attention", "moe"], action="append")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("the kernel benchmarks need a CUDA device")
    env = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    print(env, flush=True)
    rows = measure_ceilings()
    suites = {"elementwise": bench_elementwise.run, "attention": bench_attention.run, "moe": bench_moe.run}
    for name, suite in suites.items():
        if args.only and name not in args.only:
            continue
        print(f"running {name}", flush=True)
        rows += suite() if name == "elementwise" else suite(sweep=not args.quick)
    table = format_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    header = f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}\n\n"
    (args.out / "kernels.md").write_text(header + table + "\n")
    (args.out / "kernels.json").write_text(to_json(rows, env))
    print(table)


if __name__ == "__main__":
    main()
