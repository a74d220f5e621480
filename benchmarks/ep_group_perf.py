"""An expert-parallel group's decode speed, where its steps' time goes, and its lifecycle across ranks (issue 19).

    python benchmarks/ep_group_perf.py --arch qwen3_moe --world-size 2                        # CPU, tiny model, gloo
    python benchmarks/ep_group_perf.py --preset qwen3-30b-a3b --device cuda --world-size 2 --redundant 16 \\
        --out benchmarks/results/ep-group-perf-qwen3-30b-a3b-h200x2.json                     # one rank per GPU, NCCL

Starts one worker process per rank (`GroupHarness`: with --device cuda rank r sees only GPU r, as in a pod), forms
the group, and prints:
1. Outputs: greedy completions of --check-prompts prompts from every rank against one worker of world size 1 (the
   same model in this process, before the group starts): how many are identical, and where the first differs.
2. Decode at each of --batches B: B greedy streams on every rank at once. Once every stream is producing, each
   rank's /metrics are read, and again --window-s later: tokens/s per rank and for the group
   (tidal_generation_tokens_total), the group steps taken (tidal_expert_parallel_steps_total), so ms per step.
3. Unless --no-exchange-timing: the same again on a group started with --time-expert-exchanges, which gives each
   step's time in dispatch and in combine (tidal_expert_exchange_seconds_total, peers' lateness included) and the
   bytes they sent over links, set against the time those bytes take at --link-gbs (an H200's NVLink: 450 GB/s
   each way). Timing makes each exchange wait for the device first, so step 2's rates are from the untimed group.
4. Unless --no-lifecycle: a level-1 sleep and wake, a level-2 sleep and wake, and an in-place weight update (the same
   files as a new version) on every rank at once, each rank's own duration and the wall time of the slowest, then
   one completion per rank checked against the reference again.

--preset writes the preset's shape with random weights (bf16 on a GPU, fp32 on a CPU) to --dir (default: a
temporary directory) first; a --dir that already holds that preset and seed is reused. Exit status 1 if an output
differs from the reference after the lifecycle steps, or a window was cut short by a stream ending in it; a rank
that refuses a call stops the run with its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import torch
from perf.presets import PRESETS, random_prompts, write_model_dir
from perf.random_model import write_random_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from tidal.worker.testing.gpu_memory import MIB, rank_memory
from tidal.worker.testing.group_harness import GroupHarness, reference_texts
from tidal.worker.testing.tiny_models import TINY_ARCHS, write_tiny_model
from tidal.worker.testing.worker_processes import WorkerLaunch

NVLINK_H200_GBS = 450.0  # NVLink 4 on an H200 SXM: 18 links x 25 GB/s each way


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
    parser.add_argument("--num-kv-blocks", type=int, help="per rank (default: the worker's own sizing on a GPU)")
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
    wanted = {"preset": args.preset, "seed": args.seed}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        print(f"model: reusing {model_dir}", flush=True)
        return model_dir
    start = time.monotonic()
    write_model_dir(PRESETS[args.preset], model_dir)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # a CPU checks outputs exactly in fp32
    written = write_random_checkpoint(model_dir, dtype, torch.device(args.device), args.seed)
    marker.write_text(json.dumps(wanted))
    print(f"model: wrote {written / 1e9:.1f} GB of random weights in {time.monotonic() - start:.0f}s", flush=True)
    return model_dir


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# ----- reading the ranks -----


@dataclass(frozen=True)
class RankReading:
    """One rank's counters at one moment."""

    at: float  # monotonic
    generated_tokens: float
    group_steps: float  # tidal_expert_parallel_steps_total: forwards and empty steps
    exchange_seconds: dict[str, float]  # by phase; empty unless the rank times its exchanges
    exchange_bytes_sent: dict[str, float]  # by phase
    exchanges: dict[str, float]  # by phase


async def read_rank(group: GroupHarness, rank: int, client: httpx.AsyncClient) -> RankReading:
    at = time.monotonic()
    response = await client.get(f"{group.processes.serving_url(rank)}/metrics")
    response.raise_for_status()
    generated = steps = 0.0
    seconds: dict[str, float] = {}
    sent: dict[str, float] = {}
    exchanges: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            phase = sample.labels.get("phase", "")
            if sample.name == "tidal_generation_tokens_total":
                generated = sample.value
            elif sample.name == "tidal_expert_parallel_steps_total":
                steps = sample.value
            elif sample.name == "tidal_expert_exchange_seconds_total":
                seconds[phase] = sample.value
            elif sample.name == "tidal_expert_exchange_bytes_total" and sample.labels.get("direction") == "sent":
                sent[phase] = sample.value
            elif sample.name == "tidal_expert_exchanges_total":
                exchanges[phase] = sample.value
    return RankReading(at, generated, steps, seconds, sent, exchanges)


# ----- 2 and 3: decode at a batch size -----


@dataclass(frozen=True)
class RankDecode:
    rank: int
    tokens_per_s: float
    steps: int
    ms_per_step: float
    moe_layers_per_step: float  # exchanges / steps: every MoE layer exchanges once a step
    dispatch_ms_per_step: float | None
    combine_ms_per_step: float | None
    dispatch_mb_per_step: float
    combine_mb_per_step: float


@dataclass(frozen=True)
class BatchDecode:
    batch_per_rank: int
    timed_exchanges: bool
    window_s: float
    group_tokens_per_s: float
    ranks: list[RankDecode]
    cut_short: bool  # a stream ended inside the window: the rates undercount


def _delta(after: dict[str, float], before: dict[str, float], phase: str) -> float:
    return after.get(phase, 0.0) - before.get(phase, 0.0)


def rank_decode(rank: int, before: RankReading, after: RankReading) -> RankDecode:
    elapsed = after.at - before.at
    steps = int(after.group_steps - before.group_steps)
    per_step = max(steps, 1)
    timed = bool(after.exchange_seconds)

    def ms(phase: str) -> float | None:
        return 1000 * _delta(after.exchange_seconds, before.exchange_seconds, phase) / per_step if timed else None

    return RankDecode(
        rank=rank,
        tokens_per_s=(after.generated_tokens - before.generated_tokens) / elapsed,
        steps=steps,
        ms_per_step=1000 * elapsed / per_step,
        moe_layers_per_step=_delta(after.exchanges, before.exchanges, "dispatch") / per_step,
        dispatch_ms_per_step=ms("dispatch"),
        combine_ms_per_step=ms("combine"),
        dispatch_mb_per_step=_delta(after.exchange_bytes_sent, before.exchange_bytes_sent, "dispatch") / per_step / 1e6,
        combine_mb_per_step=_delta(after.exchange_bytes_sent, before.exchange_bytes_sent, "combine") / per_step / 1e6,
    )


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


@dataclass(frozen=True)
class OutputCheck:
    rank: int
    prompt: int
    identical: bool
    first_difference: int | None  # character index where the texts part, None when identical


def compare(rank: int, prompt: int, text: str, reference: str) -> OutputCheck:
    if text == reference:
        return OutputCheck(rank, prompt, True, None)
    first = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b), None)
    return OutputCheck(rank, prompt, False, first if first is not None else min(len(text), len(reference)))


async def check_outputs(
    group: GroupHarness, prompts: list[list[int]], reference: list[str], max_tokens: int
) -> list[OutputCheck]:
    checks = []
    for rank in group.processes.ranks:
        for i, prompt in enumerate(prompts):
            checks.append(compare(rank, i, await group.complete(rank, prompt, max_tokens), reference[i]))
    return checks


@dataclass(frozen=True)
class GroupTransition:
    step: str
    wall_s: float  # from the calls to the last answer
    rank_durations_s: list[float]  # each rank's own duration_s
    bytes_moved: int  # over all ranks


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


def kv_blocks(args: argparse.Namespace) -> int | None:
    """--num-kv-blocks, else on a CPU enough 16-token blocks for the largest batch's streams (on a GPU the worker
    sizes its cache from the memory left)."""
    if args.num_kv_blocks is not None or args.device == "cuda":
        return args.num_kv_blocks
    tokens = max(max(args.batches), args.check_prompts) * (args.prompt_len + max(args.max_tokens, args.check_tokens))
    return -(-tokens // 16) + 16


def reference_in_child(launch: WorkerLaunch, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """`reference_texts` in a process of its own: on a GPU the one-rank worker's memory is all given back before
    rank 0 starts on the same GPU."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(reference_texts, launch, prompts, max_tokens).result()


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
        memory = rank_memory(launch.visible_devices, group.processes.ranks)
        if memory is not None:
            results["gpu_memory_mib"] = {rank: used // MIB for rank, used in memory.items()}
        if reference is not None:
            checks = await check_outputs(group, prompts[: args.check_prompts], reference, args.check_tokens)
            results["outputs"] = [asdict(c) for c in checks]
        results["decode"] = [asdict(await measure_batch(group, b, prompts, args)) for b in args.batches]
        if reference is not None and not args.no_lifecycle:
            results["lifecycle"] = [asdict(t) for t in await lifecycle(group, launch.model_path, args.timeout_s)]
            after = await check_outputs(group, prompts[:1], reference[:1], args.check_tokens)
            results["outputs_after_lifecycle"] = [asdict(c) for c in after]
    return results


def print_decode(batches: list[dict[str, Any]], link_gbs: float) -> None:
    for batch in batches:
        flag = "  (CUT SHORT: raise --max-tokens)" if batch["cut_short"] else ""
        timed = "exchanges timed" if batch["timed_exchanges"] else "untimed"
        print(f"batch {batch['batch_per_rank']} per rank, {timed}: group {batch['group_tokens_per_s']:.1f} tok/s{flag}")
        for r in batch["ranks"]:
            sent_kb = 1000 * (r["dispatch_mb_per_step"] + r["combine_mb_per_step"])
            line = f"  rank {r['rank']}: {r['tokens_per_s']:9.1f} tok/s {r['ms_per_step']:8.2f} ms/step"
            line += f" ({r['moe_layers_per_step']:.0f} MoE layers); sent {sent_kb:8.1f} KB/step"
            if r["dispatch_ms_per_step"] is not None:
                link_us = sent_kb / link_gbs  # KB / (GB/s) = us
                line += f"; dispatch {r['dispatch_ms_per_step']:.3f} + combine {r['combine_ms_per_step']:.3f} ms/step"
                line += f" (the bytes alone at {link_gbs:g} GB/s: {link_us:.1f} us)"
            print(line)


def summarize(results: dict[str, Any], link_gbs: float) -> int:
    failures = 0
    for key in ("outputs", "outputs_after_lifecycle"):
        checks = results.get(key)
        if checks:
            same = sum(c["identical"] for c in checks)
            parts = [
                f"rank {c['rank']} prompt {c['prompt']} at char {c['first_difference']}"
                for c in checks
                if not c["identical"]
            ]
            print(
                f"{key}: {same} of {len(checks)} identical to the world-size-1 worker"
                + (f"; differ: {parts}" if parts else "")
            )
            if key == "outputs_after_lifecycle":
                failures += len(checks) - same
    print_decode(results["decode"], link_gbs)
    if "decode_timed" in results:
        print_decode(results["decode_timed"], link_gbs)
    failures += sum(b["cut_short"] for b in results["decode"] + results.get("decode_timed", []))
    if "gpu_memory_mib" in results:
        print(f"GPU memory in use per rank's GPU once loaded (MiB): {results['gpu_memory_mib']}")
    for t in results.get("lifecycle", []):
        durations = ", ".join(f"{d:.2f}" for d in t["rank_durations_s"])
        print(
            f"{t['step']:<42} {t['wall_s']:7.2f} s for the group (ranks: {durations}); {t['bytes_moved'] / 1e9:.2f} GB"
        )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ep-group-perf-") as tmp:
        model_dir = prepare_model(args, Path(tmp))
        prompts = random_prompts(max(max(args.batches), args.check_prompts), args.prompt_len, vocab_size(model_dir), 0)
        untimed = launch_for(args, model_dir, timed=False)
        reference = reference_in_child(untimed, prompts[: args.check_prompts], args.check_tokens)
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
