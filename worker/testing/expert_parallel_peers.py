"""Expert-parallel tests on a CPU: N processes on loopback joined by a gloo process group, and an `ExpertComm` over
it (the worker's own groups, tidal.worker.group, build theirs per epoch; these tests need only the collectives).

    results = run_peers(4, scenario, args)   # scenario(rank, world_size, *args) runs in each process

A scenario is a module-level function (the processes are spawned, so it is imported by name); it returns a picklable
value, and any exception in any process fails `run_peers` with that process's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import get_context
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist


class GlooExpertComm:
    """An ExpertComm over `group` (the default group when None), whose members are the global ranks `members`."""

    def __init__(self, members: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
        self.members = tuple(members)
        self.group = group
        self.size = len(self.members)
        self.group_rank = self.members.index(dist.get_rank())

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return received

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        received = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(received, send.contiguous(), recv_counts, send_counts, group=self.group)
        return received


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_peers(
    world_size: int, scenario: Callable[..., Any], args: tuple[Any, ...] = (), timeout_s: float = 120.0
) -> list[Any]:
    """Run `scenario(rank, world_size, *args)` in `world_size` spawned processes of one gloo group -> each rank's
    return value, by rank. RuntimeError with the tracebacks if a process fails or the run outlasts `timeout_s`."""
    context = get_context("spawn")
    results: Queue[tuple[int, bool, Any]] = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_peer, args=(rank, world_size, port, scenario, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    by_rank: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                by_rank[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break  # its peers may now wait forever on a collective
    except Exception as err:  # queue.Empty: nobody answered in time
        failures.append(f"no answer from ranks {sorted(set(range(world_size)) - set(by_rank))}: {err!r}")
    finally:
        for process in processes:
            process.join(timeout=5 if not failures else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    if failures:
        raise RuntimeError("expert-parallel peers failed:\n" + "\n".join(failures))
    return [by_rank[rank] for rank in range(world_size)]


def _peer(
    rank: int,
    world_size: int,
    port: int,
    scenario: Callable[..., Any],
    args: tuple[Any, ...],
    results: Queue[tuple[int, bool, Any]],
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # N processes share a few cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        value = scenario(rank, world_size, *args)
        dist.barrier()  # no process leaves the group while a peer may still be exchanging with it
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
