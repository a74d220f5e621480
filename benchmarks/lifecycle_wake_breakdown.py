"""Where a level-1 wake's time goes on CUDA: mapping the weight and KV regions, and the host->device weights copy.

Measures, with the worker's own `VmmRegion`, each part alone and then the orders a wake can use, for two physical
chunk sizes: `python benchmarks/lifecycle_wake_breakdown.py [--weights-gib 15] [--kv-gib 111] [--trials 3]`.
No model is involved; the sizes default to a Llama-3-8B-shaped model with a 90% KV cache on an H200.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-gib", type=float, default=15.0)
    parser.add_argument("--kv-gib", type=float, default=111.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--chunks-gib", type=int, nargs="+", default=[2, 16], help="physical piece sizes to try")
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
        for name, seconds in measure(weights, kv, host, args.trials).items():
            print(f"chunk {chunk_gib:>2} GiB  {name:<24} {seconds * 1000:8.1f} ms", flush=True)
        weights.release()
        kv.release()


if __name__ == "__main__":
    main()
