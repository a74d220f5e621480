"""Where a level-1 wake's time goes on CUDA: mapping the weight and KV regions, and the host->device weights copy.

Measures, with the worker's own `VmmRegion`, each part alone and then the orders a wake can use, for two physical
chunk sizes: `python benchmarks/lifecycle_wake_breakdown.py [--weights-gib 15] [--kv-gib 111] [--trials 3]`.
No model is involved; the sizes default to a Llama-3-8B-shaped model with a 90% KV cache on an H200.

`--after-sleep` measures instead what makes a wake issued right after a level-1 sleep slower than one issued
seconds later (issue 18: 1.94x against 1.16x the copy time): the same wake after each part of a sleep (the
device-to-host copy, the release) with and without a pause, and how the driver's free-memory figure moves after a
release.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from tidal.worker.memory import regions
from tidal.worker.memory.regions import VmmRegion

GIB = 2**30


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(weights: VmmRegion, kv: VmmRegion, host: torch.Tensor, trials: int) -> dict[str, float]:
    def release() -> None:
        weights.release()
        kv.release()

    def copy() -> None:
        weights.tensor.copy_(host, non_blocking=True)

    def serial_overlap() -> None:  # the current wake: map weights, queue the copy, map the KV cache meanwhile
        weights.restore()
        copy()
        kv.restore()

    def threaded() -> None:  # map the KV cache on a second thread from the start
        worker = threading.Thread(target=kv.restore)
        worker.start()
        weights.restore()
        copy()
        worker.join()

    def create_during_copy() -> None:  # physical KV memory created while the copy runs, mapped right after
        weights.restore()
        copy()
        kv.prepare_restore()
        kv.restore()

    def create_during_copy_map_after() -> None:  # ... and mapped only once the copy is done
        weights.restore()
        copy()
        kv.prepare_restore()
        torch.cuda.synchronize()
        kv.restore()

    def map_created() -> None:
        kv.prepare_restore()
        timed_parts["map kv (created ahead)"] = timed(kv.restore)

    timed_parts: dict[str, float] = {}

    best: dict[str, float] = {}
    for _ in range(trials):
        release()
        results = {"map weights": timed(weights.restore), "map kv": timed(kv.restore), "copy weights": timed(copy)}
        kv.release()
        results["create kv"] = timed(kv.prepare_restore)
        kv.discard_prepared()
        map_created()
        results.update(timed_parts)
        cases = (
            ("wake: serial overlap", serial_overlap),
            ("wake: kv on a thread", threaded),
            ("wake: create kv during copy", create_during_copy),
            ("wake: create during, map after", create_during_copy_map_after),
        )
        for name, fn in cases:
            release()
            results[name] = timed(fn)
        for name, seconds in results.items():
            best[name] = min(best.get(name, float("inf")), seconds)
    return best


def copy_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
    """One copy's own time on the device (CUDA events), apart from the host's wait for it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def free_memory_trace(seconds: float, every_s: float = 0.005) -> list[tuple[float, int]]:
    """(time since the call, free bytes) samples of cudaMemGetInfo, to see freed memory appear over time."""
    samples = []
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        samples.append((now, torch.cuda.mem_get_info()[0]))
        time.sleep(every_s)
    return samples


def probe_trace(host: torch.Tensor, seconds: float = 1.0, probe_bytes: int = 64 * 2**20) -> str:
    """The host->device copy rate of a small probe (into memory allocated before the release) over the `seconds`
    after a release, in 50 ms buckets: shows when whatever the release started stops competing with copies."""
    dst = torch.empty(probe_bytes, dtype=torch.uint8, device="cuda")
    src = host[:probe_bytes]
    buckets: dict[int, list[float]] = {}
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        buckets.setdefault(int(now / 0.05), []).append(probe_bytes / copy_seconds(dst, src) / 1e9)
    return ", ".join(f"{b * 50}ms {sum(r) / len(r):.0f}" for b, r in sorted(buckets.items())) + " (GB/s)"


def after_sleep(weights: VmmRegion, kv: VmmRegion, host: torch.Tensor, trials: int) -> None:
    """A wake (map the weights, copy them in, map the KV cache) after a sleep's parts, each case `trials` times."""

    def wake() -> tuple[float, float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        weights.restore()
        t1 = time.perf_counter()
        copy = copy_seconds(weights.tensor, host)
        kv.restore()
        torch.cuda.synchronize()
        return t1 - t0, copy, time.perf_counter() - t0

    def sleep(d2h: bool, pause_before_release_s: float, pause_after_s: float) -> None:
        if d2h:
            copy_seconds(host, weights.tensor)
        time.sleep(pause_before_release_s)
        weights.release()
        kv.release()
        time.sleep(pause_after_s)

    cases = (
        ("d2h, release, wake at once (the slow case)", True, 0.0, 0.0),
        ("d2h, release, wake 2 s later", True, 0.0, 2.0),
        ("release only, wake at once", False, 0.0, 0.0),
        ("d2h, 2 s, release, wake at once", True, 2.0, 0.0),
        ("d2h, release, wake 0.5 s later", True, 0.0, 0.5),
        ("d2h, release, wake 0.25 s later", True, 0.0, 0.25),
        ("d2h, release, wake 0.1 s later", True, 0.0, 0.1),
    )
    for name, d2h, before, after in cases:
        for trial in range(trials):
            sleep(d2h, before, after)
            mapped, copy, total = wake()
            print(
                f"{name:<44} trial {trial}: map weights {mapped * 1000:6.1f} ms, copy {copy * 1000:6.1f} ms "
                f"({host.numel() / copy / 1e9:5.1f} GB/s), whole wake {total * 1000:6.1f} ms",
                flush=True,
            )
    parts = (("weights and KV", (weights, kv)), ("weights only", (weights,)), ("KV only", (kv,)))
    for label, regions_released in parts:
        for region in regions_released:
            region.release()
        print(f"after releasing {label}: {probe_trace(host)}", flush=True)
        for region in regions_released:
            region.restore()
    one_region = (("release weights only, wake at once", (weights,)), ("release KV only, wake at once", (kv,)))
    for name, released in one_region:
        torch.cuda.synchronize()
        for region in released:
            region.release()
        t0 = time.perf_counter()
        if not weights.is_resident:
            weights.restore()
        copy = copy_seconds(weights.tensor, host)
        if not kv.is_resident:
            kv.restore()
        torch.cuda.synchronize()
        print(f"{name:<44} copy {copy * 1000:6.1f} ms, whole {1000 * (time.perf_counter() - t0):6.1f} ms", flush=True)
    copy_seconds(host, weights.tensor)
    weights.release()
    kv.release()
    trace = free_memory_trace(2.0)
    first, last = trace[0], trace[-1]
    settled = next((t for t, free in trace if free >= last[1] - 64 * 2**20), last[0])
    print(
        f"after a release: free {first[1] / GIB:.2f} GiB at {first[0] * 1000:.1f} ms, {last[1] / GIB:.2f} GiB at "
        f"{last[0] * 1000:.0f} ms; within 64 MiB of the final figure after {settled * 1000:.1f} ms",
        flush=True,
    )
    weights.restore()
    kv.restore()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-gib", type=float, default=15.0)
    parser.add_argument("--kv-gib", type=float, default=111.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--chunks-gib", type=int, nargs="+", default=[2, 16], help="physical piece sizes to try")
    parser.add_argument("--after-sleep", action="store_true", help="measure a wake right after a sleep's parts")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    host = torch.empty(int(args.weights_gib * GIB), dtype=torch.uint8, pin_memory=True)
    print(
        f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; weights {args.weights_gib} GiB, "
        f"KV {args.kv_gib} GiB; best of {args.trials}",
        flush=True,
    )
    for chunk_gib in args.chunks_gib:
        regions.VMM_CHUNK_BYTES = chunk_gib * GIB
        weights = VmmRegion(int(args.weights_gib * GIB), device)
        kv = VmmRegion(int(args.kv_gib * GIB), device)
        if args.after_sleep:
            after_sleep(weights, kv, host, args.trials)
            weights.release()
            kv.release()
            continue
        for name, seconds in measure(weights, kv, host, args.trials).items():
            print(f"chunk {chunk_gib:>2} GiB  {name:<24} {seconds * 1000:8.1f} ms", flush=True)
        weights.release()
        kv.release()


if __name__ == "__main__":
    main()
