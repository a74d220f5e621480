"""An expert-parallel group's decode speed, where its steps' time goes, and its lifecycle across ranks (issue 19).

    python benchmarks/ep_group_perf.py --arch qwen3_moe --world-size 2                        # CPU, tiny model, gloo
    python benchmarks/ep_group_perf.py --preset qwen3-30b-a3b --device cuda --world-size 2 --redundant 16 \\
        --out benchmarks/results/ep-group-perf-qwen3-30b-a3b-h200x2.json                     # one rank per GPU, NCCL

Starts one worker process per rank (`GroupHarness`: with --device cuda rank r sees only GPU r, as in a pod), forms
the group, and prints:
1. Outputs: greedy completions of --check-prompts prompts from every rank against one worker of world size 1 (the
   same model, in a process of its own before the group starts): how many are identical, and where the first
   differs.
2. Decode at each of --batches B: B greedy streams on every rank at once. Once every stream is producing, each
   rank's /metrics are read, and again --window-s later: tokens/s per rank and for the group
   (tidal_generation_tokens_total), the group steps taken (tidal_expert_parallel_steps_total), so ms per step.
   With --device cuda, then the memory in use on each rank's GPU (nvidia-smi: NCCL's buffers included).
3. Unless --no-exchange-timing: the same again on a group started with --time-expert-exchanges, which gives each
   step's time in dispatch and in combine (tidal_expert_exchange_seconds_total, peers' lateness included; also per
   layer, the unit DeepEP reports) and the bytes they sent over links, set against the time those bytes take at
   --link-gbs (an H200's NVLink: 450 GB/s each way). Timing makes each exchange wait for the device first, so step
   2's rates are from the untimed group.
4. Unless --no-lifecycle: a level-1 sleep and wake, a level-2 sleep and wake, and an in-place weight update (the same
   files as a new version) on every rank at once, each rank's own duration and the wall time of the slowest, then
   one completion per rank checked against the reference again.

--preset writes the preset's shape with random weights (bf16 on a GPU, fp32 on a CPU) to --dir (default: a
temporary directory) first; a --dir that already holds that preset and seed is reused. Exit status 1 if an output
differs from the reference (before or after the lifecycle steps), or a window was cut short by a stream ending in
it; a rank that refuses a call stops the run with its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
from perf.ep_group import (
    NVLINK_H200_GBS,
    BatchDecode,
    GroupTransition,
    OutputCheck,
    RankReading,
    compare,
    parse_reading,
    rank_decode,
    summarize,
)
from perf.presets import PRESETS, random_prompts, write_model_dir
from perf.random_model import write_random_checkpoint

from tidal.worker.testing.gpu_memory import MIB, rank_memory
from tidal.worker.testing.group_harness import GroupHarness, reference_texts
from tidal.worker.testing.tiny_models import TINY_ARCHS, write_tiny_model
from tidal.worker.testing.worker_processes import WorkerLaunch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a model directory")
    source.add_argument("--preset", choices=sorted(p for p, v in PRESETS.items() if v.gpu_workload == "moe"))
    source.add_argument("--arch", default="qwen3_moe", choices=sorted(TINY_ARCHS), help="tiny model to write")
    parser.add_argument("--dir", type=Path, help="--preset: where its random checkpoint is written (kept)")
    parser.add_argument("--seed", type=int, default=0, help="--preset: the random weights' seed")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--redundant", type=int, default=1, help="redundant expert slots per rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, help="per rank (default: enough for the largest batch)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="streams per rank")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of each random prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per stream: must outlast the window")
    parser.add_argument("--window-s", type=float, default=2.0, help="how long each batch is measured")
    parser.add_argument("--check-prompts", type=int, default=4, help="prompts checked against the reference")
    parser.add_argument("--check-tokens", type=int, default=32, help="tokens of each checked completion")
    parser.add_argument("--link-gbs", type=float, default=NVLINK_H200_GBS, help="link bandwidth each way, GB/s")
    parser.add_argument("--no-exchange-timing", action="store_true", help="skip step 3 (a second group start)")
    parser.add_argument("--no-lifecycle", action="store_true", help="skip step 4")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit of each wait (a load, a call)")
    parser.add_argument("--worker-flag", action="append", default=[], help="passed to every worker ('--x=1')")
    parser.add_argument("--workdir", type=Path, help="keep the workers' logs here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be 2 or more: this measures a group")
    return args


# ----- the model -----


def prepare_model(args: argparse.Namespace, tmp: Path) -> Path:
    if args.model is not None:
        return Path(args.model)
    if args.preset is None:
        return write_tiny_model(args.arch, tmp / args.arch)
    model_dir = (args.dir or tmp) / args.preset
    marker = model_dir / "tidal-random-checkpoint.json"
    dtype = "bfloat16" if args.device == "cuda" else "float32"  # a CPU checks outputs exactly in fp32
    wanted = {"preset": args.preset, "seed": args.seed, "dtype": dtype, "drawn_on": args.device}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        print(f"model: reusing {model_dir}", flush=True)
        return model_dir
    start = time.monotonic()
    write_model_dir(PRESETS[args.preset], model_dir)
    # In a child on a GPU: this process then holds no CUDA context or cached blocks on rank 0's GPU.
    written = in_child(
        args.device, write_random_checkpoint, model_dir, getattr(torch, dtype), torch.device(args.device), args.seed
    )
    marker.write_text(json.dumps(wanted))
    print(f"model: wrote {written / 1e9:.1f} GB of random weights in {time.monotonic() - start:.0f}s", flush=True)
    return model_dir


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# ----- reading the ranks -----


async def read_rank(group: GroupHarness, rank: int, client: httpx.AsyncClient) -> RankReading:
    at = time.monotonic()
    response = await client.get(f"{group.processes.serving_url(rank)}/metrics")
    response.raise_for_status()
    return parse_reading(at, response.text)


# ----- 2 and 3: decode at a batch size -----


async def measure_batch(
    group: GroupHarness, batch: int, prompts: list[list[int]], args: argparse.Namespace
) -> BatchDecode:
    ranks = group.processes.ranks
    streams = [prompts[i % len(prompts)] for i in range(batch * len(ranks))]
    async with httpx.AsyncClient(timeout=30.0) as client, group.load(streams, args.max_tokens).start() as load:
        await load.wait_streaming(args.timeout_s)
        before = await asyncio.gather(*(read_rank(group, r, client) for r in ranks))
        await asyncio.sleep(args.window_s)
        after = await asyncio.gather(*(read_rank(group, r, client) for r in ranks))
        window_end = min(reading.at for reading in after)
        cut_short = any(r.ended_at is not None and r.ended_at < window_end for r in load.records)
    per_rank = [rank_decode(r, b, a) for r, b, a in zip(ranks, before, after, strict=True)]
    return BatchDecode(
        batch_per_rank=batch,
        timed_exchanges=any(r.dispatch_ms_per_step is not None for r in per_rank),
        window_s=args.window_s,
        group_tokens_per_s=sum(r.tokens_per_s for r in per_rank),
        ranks=per_rank,
        cut_short=cut_short,
    )


# ----- 1 and 4: outputs and lifecycle -----


async def check_outputs(
    group: GroupHarness, prompts: list[list[int]], reference: list[str], max_tokens: int
) -> list[OutputCheck]:
    checks = []
    for rank in group.processes.ranks:
        for i, prompt in enumerate(prompts):
            checks.append(compare(rank, i, await group.complete(rank, prompt, max_tokens), reference[i]))
    return checks


async def on_every_rank(
    group: GroupHarness, step: str, path: str, body: dict[str, Any], timeout_s: float
) -> GroupTransition:
    ranks = group.processes.ranks
    start = time.monotonic()
    answers = await asyncio.gather(*(group.control(r, path, body, timeout_s=timeout_s) for r in ranks))
    wall = time.monotonic() - start
    moved = sum(int(a.get("bytes_moved", a.get("bytes_loaded", 0))) for a in answers)
    return GroupTransition(step, wall, [float(a["duration_s"]) for a in answers], moved)


async def lifecycle(group: GroupHarness, model_dir: Path, timeout_s: float) -> list[GroupTransition]:
    steps = [
        ("sleep level 1", "/sleep", {"level": 1}),
        ("wake from level 1", "/wake_up", {}),
        ("sleep level 2", "/sleep", {"level": 2}),
        ("wake from level 2", "/wake_up", {}),
        ("weight update (same files, new version)", "/weights/update", {"source": str(model_dir), "version": "v2"}),
    ]
    return [await on_every_rank(group, name, path, body, timeout_s) for name, path, body in steps]


# ----- the run -----


def kv_blocks(args: argparse.Namespace) -> int:
    """--num-kv-blocks, else enough 16-token blocks for the largest batch's streams. An expert-parallel worker is
    always given a count: on a GPU it does not size its cache by profiling (its peers would wait on the profile)."""
    if args.num_kv_blocks is not None:
        return int(args.num_kv_blocks)
    tokens = max(max(args.batches), args.check_prompts) * (args.prompt_len + max(args.max_tokens, args.check_tokens))
    return -(-tokens // 16) + 16


_T = TypeVar("_T")


def in_child(device: str, work: Callable[..., _T], *args: Any) -> _T:
    """`work(*args)` in a spawned process of its own on a GPU, so that every byte it took there (the CUDA context
    included) is given back before the ranks start; here on a CPU."""
    if device != "cuda":
        return work(*args)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(work, *args).result()


def launch_for(args: argparse.Namespace, model_dir: Path, timed: bool) -> WorkerLaunch:
    flags = [*args.worker_flag, f"--max-num-seqs={max(max(args.batches), args.check_prompts)}"]
    if timed:
        flags.append("--time-expert-exchanges")
    devices = tuple(str(i) for i in range(torch.cuda.device_count())) if args.device == "cuda" else None
    if devices is not None and len(devices) < args.world_size:
        shared = f"{args.world_size} ranks share {len(devices)} GPU(s)"
        print(f"note: {shared}; NCCL refuses that: add --worker-flag=--group-backend=gloo", file=sys.stderr)
    return WorkerLaunch(
        model_path=model_dir,
        world_size=args.world_size,
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=kv_blocks(args),
        redundant_experts_per_rank=args.redundant,
        log_level="warning",
        extra_flags=tuple(flags),
        visible_devices=devices,
    )


async def run_group(
    args: argparse.Namespace, launch: WorkerLaunch, prompts: list[list[int]], reference: list[str] | None
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with GroupHarness(launch, workdir=args.workdir, load_timeout_s=args.timeout_s, watch=False) as group:
        if reference is not None:
            checks = await check_outputs(group, prompts[: args.check_prompts], reference, args.check_tokens)
            results["outputs"] = [asdict(c) for c in checks]
        results["decode"] = [asdict(await measure_batch(group, b, prompts, args)) for b in args.batches]
        # Read once the ranks have served: NCCL makes its buffers at the first collective, after the group forms.
        memory = rank_memory(launch.visible_devices, group.processes.ranks)
        if memory is not None:
            results["gpu_memory_mib"] = {rank: used // MIB for rank, used in memory.items()}
        if reference is not None and not args.no_lifecycle:
            results["lifecycle"] = [asdict(t) for t in await lifecycle(group, launch.model_path, args.timeout_s)]
            after = await check_outputs(group, prompts[:1], reference[:1], args.check_tokens)
            results["outputs_after_lifecycle"] = [asdict(c) for c in after]
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ep-group-perf-") as tmp:
        model_dir = prepare_model(args, Path(tmp))
        # One prompt per stream of the largest batch on every rank: no two streams share tokens, experts or a
        # cached prefix.
        streams = max(max(args.batches) * args.world_size, args.check_prompts)
        prompts = random_prompts(streams, args.prompt_len, vocab_size(model_dir), 0)
        untimed = launch_for(args, model_dir, timed=False)
        reference = in_child(args.device, reference_texts, untimed, prompts[: args.check_prompts], args.check_tokens)
        results = asyncio.run(run_group(args, untimed, prompts, reference))
        if not args.no_exchange_timing:
            timed = asyncio.run(run_group(args, launch_for(args, model_dir, timed=True), prompts, None))
            results["decode_timed"] = timed["decode"]
    status = summarize(results, args.link_gbs)
    if args.out is not None:
        record = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "host": {"cpus": os.cpu_count(), "gpus": torch.cuda.device_count() if args.device == "cuda" else 0},
            "wall_s": time.monotonic() - started,
            **results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
