"""Rank processes for the group tests: each serves a `GroupEndpoint` and runs the commands the test sends it.

The processes come from a forkserver that imported torch and this package once, so a test starts its ranks in a
fraction of a second instead of importing torch in every process; each is still a fresh process, forked from a
server that never ran pytest. The test drives them over pipes: it sends a command to several ranks, then reads
their replies, so that their collectives meet. Killing or stopping one is a signal to its pid.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tidal.worker.group.endpoint import GroupEndpoint
from tidal.worker.group.epoch_group import EpochGroup, join_epoch
from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.group.members import EpochMember

HOST = "127.0.0.1"
REPLY_TIMEOUT_S = 60.0  # a hung rank fails its test instead of hanging the session


def rows_for(source: int, destination: int, count: int, trailing: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The rows `source` sends to `destination`: distinct per pair and row, so a misplaced row shows."""
    width = 1
    for size in trailing:
        width *= size
    base = source * 10_000 + destination * 1_000
    values = base + torch.arange(count * width, dtype=torch.float64)
    return values.reshape(count, *trailing).to(dtype)


# ---- the rank's side -------------------------------------------------------------------------------------------


def _join(
    groups: dict[int, EpochGroup],
    epoch: int,
    members: list[tuple[int, str]],
    my_rank: int,
    coordinator: int,
    timeout_s: float,
    collective_timeout_s: float | None = None,
) -> None:
    epoch_members = [EpochMember(rank, address) for rank, address in members]
    groups[epoch] = join_epoch(
        epoch,
        epoch_members,
        my_rank,
        coordinator,
        torch.device("cpu"),
        timeout_s,
        collective_timeout_s=collective_timeout_s or timeout_s,
    )


def _gather(groups: dict[int, EpochGroup], epoch: int, values: list[int]) -> list[list[int]]:
    return groups[epoch].all_gather_ints(values)


def _exchange(
    groups: dict[int, EpochGroup], epoch: int, send_counts: list[int], trailing: list[int], dtype_name: str
) -> tuple[list[int], list[Any]]:
    group, dtype = groups[epoch], getattr(torch, dtype_name)
    parts = [
        rows_for(group.my_rank, dst, n, trailing, dtype) for dst, n in zip(group.members, send_counts, strict=True)
    ]
    recv_counts = group.all_to_all_counts(torch.tensor(send_counts, dtype=torch.int64)).tolist()
    received = group.all_to_all(torch.cat(parts), send_counts, recv_counts)
    return recv_counts, received.to(torch.float64).tolist()


def _publish(groups: dict[int, EpochGroup], epoch: int, key: str, value: bytes) -> None:
    groups[epoch].publish(key, value)


def _fetch(groups: dict[int, EpochGroup], epoch: int, key: str, timeout_s: float) -> bytes:
    return groups[epoch].fetch(key, timeout_s)


def _close(groups: dict[int, EpochGroup], epoch: int) -> None:
    groups.pop(epoch).close()


def _culprit(groups: dict[int, EpochGroup], epoch: int) -> tuple[int, str] | None:
    return groups[epoch].find_culprit()


COMMANDS: dict[str, Callable[..., Any]] = {
    "join": _join,
    "gather": _gather,
    "exchange": _exchange,
    "publish": _publish,
    "fetch": _fetch,
    "close": _close,
    "culprit": _culprit,
}


def rank_main(conn: Connection) -> None:
    endpoint = GroupEndpoint(HOST, 0)
    conn.send(endpoint.address)
    groups: dict[int, EpochGroup] = {}
    while True:
        command, args = conn.recv()
        started = time.monotonic()
        try:
            value = COMMANDS[command](groups, *args)
        except GroupBrokenError as err:
            conn.send(Reply("broken", err, time.monotonic() - started))
        except Exception:
            conn.send(Reply("error", traceback.format_exc(), time.monotonic() - started))
        else:
            conn.send(Reply("ok", value, time.monotonic() - started))


# ---- the test's side -------------------------------------------------------------------------------------------


@dataclass
class Reply:
    kind: str  # ok | broken (value: the GroupBrokenError) | error (value: the traceback)
    value: Any
    seconds: float  # as measured in the rank, from the command's arrival to its end


class RankProcesses:
    """Rank processes; `close()` kills whatever is left (stopped ones too), also after a failed `start`."""

    def __init__(self) -> None:
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._pipes: list[Connection] = []
        self.addresses: list[str] = []

    def start(self, count: int) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "tidal.worker.group.epoch_group", __name__])
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=rank_main, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self._processes.append(process)
            self._pipes.append(ours)
        self.addresses = [self._read(rank, REPLY_TIMEOUT_S) for rank in range(count)]

    def members(self, ranks: Sequence[int]) -> list[tuple[int, str]]:
        return [(rank, self.addresses[rank]) for rank in ranks]

    def send(self, rank: int, command: str, *args: Any) -> None:
        self._pipes[rank].send((command, args))

    def reply(self, rank: int, within_s: float = REPLY_TIMEOUT_S) -> Reply:
        reply = self._read(rank, within_s)
        assert isinstance(reply, Reply)
        return reply

    def run(
        self, command: str, args_by_rank: Mapping[int, tuple[Any, ...]], within_s: float = REPLY_TIMEOUT_S
    ) -> dict[int, Reply]:
        """`command` on each rank of `args_by_rank` at once, with its arguments; their replies (each within
        `within_s` of the last one, or the test fails)."""
        for rank, args in args_by_rank.items():
            self.send(rank, command, *args)
        return {rank: self.reply(rank, within_s) for rank in args_by_rank}

    def join(
        self,
        epoch: int,
        ranks: Sequence[int],
        coordinator: int,
        timeout_s: float = 10.0,
        collective_timeout_s: float | None = None,
    ) -> dict[int, Reply]:
        members = self.members(ranks)
        args = (epoch, members)
        return self.run("join", {r: (*args, r, coordinator, timeout_s, collective_timeout_s) for r in ranks})

    def kill(self, rank: int) -> None:
        """SIGKILL, and wait until the process is gone (its sockets closed), so that what follows sees it dead."""
        self.signal(rank, signal.SIGKILL)
        self._processes[rank].join(timeout=10)

    def signal(self, rank: int, signum: signal.Signals) -> None:
        pid = self._processes[rank].pid
        assert pid is not None
        os.kill(pid, signum)

    def close(self) -> None:
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)  # ends a stopped process too
        for process in self._processes:
            process.join(timeout=10)
        for pipe in self._pipes:
            pipe.close()

    def _read(self, rank: int, within_s: float) -> Any:
        pipe = self._pipes[rank]
        if not pipe.poll(within_s):
            raise AssertionError(f"rank {rank} did not answer within {within_s:g} s")
        return pipe.recv()


def ok(replies: dict[int, Reply]) -> dict[int, Any]:
    """The values of replies that must all be ok (else the failure, with the rank's traceback)."""
    for rank, reply in replies.items():
        assert reply.kind == "ok", f"rank {rank}: {reply.kind}: {reply.value}"
    return {rank: reply.value for rank, reply in replies.items()}
