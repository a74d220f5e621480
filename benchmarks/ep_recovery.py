"""What a rank's failure costs an expert-parallel group under load: the recovery benchmark (CPU and GPU).

    python benchmarks/ep_recovery.py --arch qwen3_moe --world-size 4 --redundant 1 --fault kill
    python benchmarks/ep_recovery.py --arch llama --world-size 2 --fault stop --out /tmp/ep-recovery.json
    python benchmarks/ep_recovery.py --model /models/Qwen3-30B-A3B --device cuda --world-size 8 --fault kill2

Starts one worker process per rank on loopback (`tidal.worker.testing.group_harness`), forms the group, and keeps
`--streams` greedy streams going over the ranks (each request sent again when it completes). Once every stream has
produced tokens it injects the fault: `kill` (SIGKILL one rank), `stop` (SIGSTOP one rank: found by its silence,
then killed) or `kill2` (SIGKILL two ranks which, with the group's expert map, hold every copy of some expert, so the
survivors must reload it). The conductor reconfigures the survivors, starts a replacement for each failed rank and
brings the group back whole; the load stops `--settle-s` after that. Prints, and writes as JSON with `--out`: the
survivors' serving interruption (longest gap between two tokens of a surviving stream, from the fault until the
replacement starts; and after it, at the rejoin), the time from the fault to serving again, the time until the group
is whole after the replacement starts, the expert reload time, and the requests lost on survivors and on the failed
rank(s); with --device cuda also the memory in use on each survivor's GPU just before the fault and once the group
is whole again (nvidia-smi: NCCL's buffers of the old epoch's group included, if they were kept). Outputs are
checked against a single worker of world_size 1 (`--no-reference` skips it).

With `--device cuda`, rank r sees GPU r mod (the GPUs visible) as its only device (CUDA_VISIBLE_DEVICES), as in a pod.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tidal.worker.testing.gpu_memory import MIB, rank_memory
from tidal.worker.testing.group_conductor import EventKind, GroupConductorError
from tidal.worker.testing.group_harness import GroupHarness, ranks_holding_every_copy, reference_texts
from tidal.worker.testing.recovery_metrics import RecoveryReport, recovery_report
from tidal.worker.testing.tiny_models import TINY_ARCHS, write_tiny_model
from tidal.worker.testing.worker_processes import WorkerLaunch, WorkerProcesses

FAULTS = ("kill", "stop", "kill2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a model directory (default: a tiny random model of --arch)")
    source.add_argument("--arch", default="qwen3_moe", choices=sorted(TINY_ARCHS), help="tiny model to write")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--redundant", type=int, default=1, help="redundant expert slots per rank")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams, round-robin over the ranks")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--fault", choices=FAULTS, default="kill")
    parser.add_argument("--fault-rank", type=int, help="kill/stop: the rank to fail (default: the last)")
    parser.add_argument("--fault-after-s", type=float, default=0.5, help="wait after every stream has tokens")
    parser.add_argument("--no-replace", action="store_true", help="do not start a replacement for a failed rank")
    parser.add_argument("--settle-s", type=float, default=1.0, help="keep the load this long after whole again")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--group-timeout-s", type=float, help="the workers' collective deadline (their default)")
    parser.add_argument("--unresponsive-after-s", type=float, default=1.0, help="silence that fails a rank")
    parser.add_argument("--poll-interval-s", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit of each wait of the run")
    parser.add_argument("--no-reference", action="store_true", help="skip checking outputs against one worker")
    parser.add_argument("--worker-flag", action="append", default=[], help="passed to every worker ('--x=1')")
    parser.add_argument("--workdir", type=Path, help="keep the workers' logs here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.fault == "kill2" and args.world_size < 3:
        parser.error("--fault kill2 needs --world-size 3 or more (a survivor must remain)")
    if args.fault_rank is not None and not 0 <= args.fault_rank < args.world_size:
        parser.error(f"--fault-rank must be in 0..{args.world_size - 1}")
    return args


def visible_devices(device: str, world_size: int) -> tuple[str, ...] | None:
    if device != "cuda":
        return None
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise SystemExit("--device cuda: no GPU is visible")
    if count < world_size:
        print(f"note: {world_size} ranks share {count} GPU(s)", file=sys.stderr)
    return tuple(str(i) for i in range(count))


def prompts_for(streams: int) -> list[str]:
    return [f"Request {i}: the tide turns, and the group" for i in range(streams)]


def inject(processes: WorkerProcesses, fault: str, ranks: list[int]) -> float:
    """The fault's moment: the first signal sent."""
    times = [processes.freeze(rank) if fault == "stop" else processes.kill(rank) for rank in ranks]
    return min(times)


async def run(
    args: argparse.Namespace, launch: WorkerLaunch, reference: list[str] | None
) -> tuple[RecoveryReport, dict[str, object]]:
    prompts = prompts_for(args.streams)
    conductor_options = {
        "poll_interval_s": args.poll_interval_s,
        "unresponsive_after_s": args.unresponsive_after_s,
        "replace_failed": not args.no_replace,
    }
    notes: dict[str, object] = {}
    async with GroupHarness(launch, workdir=args.workdir, load_timeout_s=args.timeout_s, **conductor_options) as group:
        conductor = group.conductor
        formed = conductor.applied
        assert formed is not None
        expert_map = formed.results[0].expert_map
        if args.fault == "kill2":
            failed = ranks_holding_every_copy(expert_map, args.world_size, 2)
        else:
            failed = [args.fault_rank if args.fault_rank is not None else args.world_size - 1]
        async with group.load(prompts, args.max_tokens).start(repeat=True) as load:
            await load.wait_streaming(args.timeout_s)
            await asyncio.sleep(args.fault_after_s)
            survivors = [r for r in group.processes.ranks if r not in failed]
            memory_before = rank_memory(launch.visible_devices, survivors)
            fault_at = inject(group.processes, args.fault, failed)
            try:
                if args.no_replace:
                    await conductor.wait_for(EventKind.EPOCH_APPLIED, after=fault_at, timeout_s=args.timeout_s)
                else:
                    await conductor.wait_whole(after=fault_at, timeout_s=args.timeout_s)
            except GroupConductorError as exc:
                notes["error"] = str(exc)
            await asyncio.sleep(args.settle_s)
            memory_after = rank_memory(launch.visible_devices, survivors)
            load.stop_repeating()
            records = await load.wait(args.timeout_s)
        if memory_before is not None and memory_after is not None:
            notes["survivors_gpu_memory_mib"] = {
                rank: {"before": memory_before[rank] // MIB, "after": memory_after[rank] // MIB} for rank in survivors
            }
        if "error" not in notes and reference is not None:
            # Every rank, the replacement included, serves the reference once the group is whole again.
            wrong = []
            for rank in sorted(conductor.healthy):
                index = rank % len(prompts)
                if await group.complete(rank, prompts[index], args.max_tokens) != reference[index]:
                    wrong.append(rank)
            notes["after_recovery_correct"] = not wrong
            notes["after_recovery_wrong_ranks"] = wrong
        report = recovery_report(args.fault, fault_at, failed, conductor, records, reference)
        notes["requests_sent"] = len(records)
        notes["formed_expert_map"] = expert_map
    return report, notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ep-recovery-") as tmp:
        model = args.model if args.model is not None else write_tiny_model(args.arch, Path(tmp) / args.arch)
        launch = WorkerLaunch(
            model_path=model,
            world_size=args.world_size,
            device=args.device,
            dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks,
            redundant_experts_per_rank=args.redundant,
            group_timeout_s=args.group_timeout_s,
            log_level="warning",
            extra_flags=tuple(args.worker_flag),
            visible_devices=visible_devices(args.device, args.world_size),
        )
        started = time.monotonic()
        reference = None if args.no_reference else reference_texts(launch, prompts_for(args.streams), args.max_tokens)
        report, notes = asyncio.run(run(args, launch, reference))
    print(report.summary())
    print(f"after recovery, every rank serves the reference: {notes.get('after_recovery_correct', 'not checked')}")
    memory = notes.get("survivors_gpu_memory_mib")
    if isinstance(memory, dict):
        shown = ", ".join(f"rank {r} {m['before']} -> {m['after']} MiB" for r, m in memory.items())
        print(f"GPU memory in use on the survivors' GPUs, before the fault -> whole again: {shown}")
    if "error" in notes:
        print(f"the recovery did not finish: {str(notes['error']).splitlines()[0]}")
    print("timeline (seconds after the fault):")
    for event in report.timeline:
        print(f"  {event['t_s']:+8.3f} {event['kind']} rank={event['rank']} epoch={event['epoch']} {event['detail']}")
    if args.out is not None:
        results = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "host": {"cpus": os.cpu_count()},
            "wall_s": time.monotonic() - started,
            **report.to_json(),
            **notes,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0 if "error" not in notes and report.survivors.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
