"""A whole expert-parallel group on loopback for tests and benchmarks: processes, conductor, load, reference.

    async with GroupHarness(WorkerLaunch(model_path=..., world_size=3)) as group:   # started, loaded, formed, watched
        load = group.load(prompts, max_tokens=64).start()
        await load.wait_streaming()
        fault_at = group.processes.kill(2)                        # or .freeze(2): SIGSTOP
        records = await load.wait()
        await group.conductor.wait_whole(after=fault_at)          # survivors' epoch, replacement, whole again
        report = recovery_report("kill", fault_at, [2], group.conductor, records, reference)
        s = (await group.state(0)).group.slots_per_rank             # fixed for a worker's life
        await group.grow(4, replace(launch, world_size=4, expert_slots_per_rank=s))  # resized by epochs
        await group.shrink(3)

The parts: `worker_processes` (the rank processes and their faults), `group_conductor` (the operator's part),
`streaming_load` (timed streams), `recovery_metrics` (what the fault cost). The reference outputs come from one
worker of world_size 1 in this process (`reference_texts`), which serves the same greedy outputs by definition of
correctness.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tidal.contract.control_api import TOKEN_HEADER, WorkerState
from tidal.worker.experts.expert_map import ExpertMap
from tidal.worker.testing.group_conductor import EpochAttempt, GroupConductor
from tidal.worker.testing.in_process import ControlledWorker
from tidal.worker.testing.streaming_load import StreamingLoad, round_robin
from tidal.worker.testing.worker_processes import WorkerLaunch, WorkerProcesses


class GroupHarness:
    """`async with`: start every rank, wait until each has loaded, form the group (epoch 1 with every rank), and
    watch it (unless `watch=False`); on exit stop the watch and end every process, printing the workers' log tails
    when the block raised. `conductor_options` go to `GroupConductor`."""

    def __init__(
        self,
        launch: WorkerLaunch,
        *,
        workdir: Path | None = None,
        watch: bool = True,
        load_timeout_s: float = 120.0,
        **conductor_options: Any,
    ) -> None:
        self.launch = launch
        self.processes = WorkerProcesses(launch, workdir)
        self.conductor = GroupConductor(self.processes, load_timeout_s=load_timeout_s, **conductor_options)
        self.watch = watch
        self.load_timeout_s = load_timeout_s

    async def __aenter__(self) -> GroupHarness:
        try:
            self.processes.start_all()
            await self.processes.wait_all_loaded(self.load_timeout_s)
            await self.conductor.form()
            if self.watch:
                self.conductor.start_watching()
        except BaseException:
            await self.conductor.close()
            self.processes.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.conductor.close()
        if exc_type is not None:
            print(f"conductor events:\n{self.conductor.timeline()}", file=sys.stderr)
        self.processes.__exit__(exc_type, exc, tb)

    def load(
        self, prompts: Sequence[str | list[int]], max_tokens: int, ranks: Sequence[int] | None = None
    ) -> StreamingLoad:
        """Streams of `prompts` spread round-robin over `ranks` (default: every rank); call `.start()`."""
        requests = round_robin(prompts, list(ranks) if ranks is not None else self.processes.ranks, max_tokens)
        return StreamingLoad(self.processes.serving_url, requests, self.launch.model_name)

    async def grow(self, group_size: int, launch: WorkerLaunch) -> EpochAttempt:
        """Start the ranks from the group's current size up to `group_size` with `launch` (started for the new size
        with the running members' expert slots per rank), wait until they have loaded, and form the group of the new
        size with every rank; the ranks already there keep running. GroupConductorError when a member refuses."""
        if launch.world_size != group_size:
            raise ValueError(f"ranks joining a group of {group_size} are started with that world_size")
        joining = list(range(self.processes.group_size, group_size))
        for rank in joining:
            self.processes.start(rank, launch)
        await asyncio.gather(*(self.processes.wait_loaded(rank, self.load_timeout_s) for rank in joining))
        self.processes.group_size = group_size
        return await self.conductor.form()

    async def shrink(self, group_size: int) -> EpochAttempt:
        """Form the group of ranks 0..group_size-1; the ranks past it are left out of the epoch and then stopped, as
        the operator deletes their pods. GroupConductorError when a member refuses."""
        leaving = list(range(group_size, self.processes.group_size))
        self.processes.group_size = group_size
        attempt = await self.conductor.form()
        for rank in leaving:
            await asyncio.to_thread(self.processes.stop, rank)
        return attempt

    async def state(self, rank: int, timeout_s: float = 10.0) -> WorkerState:
        """The rank's current process's `/state`."""
        headers = {TOKEN_HEADER: f"Bearer {self.launch.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
            response = await client.get(f"{self.processes[rank].control_url}/state")
        response.raise_for_status()
        return WorkerState.model_validate(response.json())

    async def control(
        self, rank: int, path: str, body: dict[str, Any] | None, method: str = "POST", timeout_s: float = 120.0
    ) -> dict[str, Any]:
        """A control-API call to the rank's current process; RuntimeError with the answer unless it is 200."""
        headers = {TOKEN_HEADER: f"Bearer {self.launch.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=timeout_s) as client:
            response = await client.request(method, f"{self.processes[rank].control_url}{path}", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"rank {rank} {method} {path} answered {response.status_code}: {response.text[:300]}")
        answer: dict[str, Any] = response.json()
        return answer

    async def complete(self, rank: int, prompt: str | list[int], max_tokens: int, timeout_s: float = 60.0) -> str:
        """One greedy, non-streamed completion from the rank's current process."""
        body = {
            "model": self.launch.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(f"{self.processes.serving_url(rank)}/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"rank {rank} answered {response.status_code}: {response.text[:300]}")
        text: str = response.json()["choices"][0]["text"]
        return text


def reference_texts(launch: WorkerLaunch, prompts: Sequence[str | list[int]], max_tokens: int) -> list[str]:
    """Greedy outputs of `prompts` from one worker of world_size 1 in this process (same model, device, dtype and KV
    cache), one request at a time. Synchronous: call it before the event loop of the group's test starts."""
    settings: dict[str, Any] = {
        "model_path": launch.model_path,
        "device": launch.device,
        "dtype": launch.dtype,
        "log_level": "warning",  # not a line per request
    }
    if launch.num_kv_blocks is not None:
        settings["num_kv_blocks"] = launch.num_kv_blocks
    with ControlledWorker(**settings) as worker:
        return [worker.text(prompt, max_tokens) for prompt in prompts]


def ranks_holding_every_copy(expert_map: dict[str, object] | None, world_size: int, count: int) -> list[int]:
    """`count` ranks, none of them rank 0, whose loss leaves some expert with no copy when the map allows it (a fault
    that forces the survivors to reload from the checkpoint); without a map (a dense model), the highest ranks."""
    if count >= world_size:
        raise ValueError(f"failing {count} of {world_size} ranks leaves no survivor")
    fallback = list(range(world_size - count, world_size))
    if expert_map is None:
        return fallback
    parsed = ExpertMap.from_json(expert_map)
    for expert in range(parsed.num_experts):
        holders = sorted({copy.rank for copy in parsed.copies(expert)})
        if 0 in holders or len(holders) > count:
            continue
        others = [r for r in reversed(range(1, world_size)) if r not in holders]
        return sorted(holders + others[: count - len(holders)])
    return fallback
