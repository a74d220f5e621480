"""What the engine benchmarks' command lines share (gpu_perf.py, sampling_perf.py): where results go, the dtypes,
timestamped progress lines, and the options every one of them takes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import get_args

import torch

from perf.presets import PRESETS
from tidal.worker.engine.config import KVCacheDType, WeightDType

RESULTS = Path(__file__).resolve().parents[1] / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


def engine_benchmark_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options of every engine benchmark; the caller adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and markdown")
    parser.add_argument("--smoke", action="store_true", help="the smallest workload (tests)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="share of free memory for the KV cache")
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDType), default="auto", help="fp8: an e4m3 cache")
    parser.add_argument(
        "--weight-dtype", choices=get_args(WeightDType), default="auto", help="fp8: e4m3 projection and expert weights"
    )
    return parser


def parse_checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if args.weight_dtype != "auto" and not getattr(args, "skip_transformers", True):
        parser.error("--weight-dtype fp8 needs --skip-transformers (transformers would run the unquantized weights)")
    return args
