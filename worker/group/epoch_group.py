"""One membership epoch's process group: a fresh rendezvous, the collectives of a lockstep step, their deadlines.

The process group object is built directly (gloo on CPU, NCCL on CUDA), without torch.distributed's global default
group, so one process can go through any number of epochs, each with a group of its own. The rendezvous is a client
of the coordinator's group endpoint under the prefix `tidal/epoch/<epoch>`: keys of an older epoch are never read,
and an epoch whose coordinator died does not block the next one, which names another coordinator.

Every collective waits at most `collective_timeout_s`; any failure raises GroupBrokenError at once, and
`find_culprit` probes the peers' endpoints (off the step path) to name the one that is gone or frozen. The happy path
does no more than the collective itself.

Making the store client and reading the epoch's store are held to their timeout even when the coordinator's endpoint
accepts and never answers (a frozen coordinator), which torch's store client alone does not do (see
`rendezvous_deadline`): otherwise the rank's preparation of the epoch blocks forever, its thread and store connection
with it, and the operator's call never gets an answer. A coordinator that freezes after the client was made, during
the backend's setup, still holds that setup: the deadline cannot cover it without misjudging members that arrive one
after another within their own timeouts.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.group.members import EpochMember
from tidal.worker.group.probe import probe_peers
from tidal.worker.group.rendezvous_deadline import RendezvousDeadline

log = logging.getLogger(__name__)

GroupBackend = Literal["auto", "gloo", "nccl"]

_PROBE_TIMEOUT_S = 0.5


def join_epoch(
    epoch: int,
    members: Sequence[EpochMember],
    my_rank: int,
    coordinator_rank: int,
    device: torch.device,
    timeout_s: float,
    collective_timeout_s: float,
    backend: GroupBackend = "auto",
) -> EpochGroup:
    """Rendezvous with every member of `epoch` (waiting up to `timeout_s` for the last one) -> the epoch's group.
    `backend`: "auto" is NCCL on CUDA and gloo on CPU; "gloo" on CUDA stages every exchange through host memory
    (several ranks sharing one GPU, which NCCL refuses). GroupBrokenError when a member does not arrive in time or
    the coordinator cannot be reached or does not answer (within `timeout_s` and a grace of a second)."""
    ordered = sorted(members, key=lambda m: m.rank)
    ranks = [m.rank for m in ordered]
    if my_rank not in ranks or coordinator_rank not in ranks:
        raise ValueError(f"rank {my_rank} and coordinator {coordinator_rank} must be among the members {ranks}")
    coordinator = ordered[ranks.index(coordinator_rank)]
    join_timeout = datetime.timedelta(seconds=timeout_s)
    group_rank, size = ranks.index(my_rank), len(ranks)
    use_nccl = device.type == "cuda" and backend != "gloo"
    # The client's construction (connect, then a ping with no deadline of its own) is held to the deadline; the
    # backend's setup is not: gloo waits on each member with its own timeout, so members arriving one after
    # another may take longer than one timeout in all, and a cut then would blame a healthy coordinator.
    deadline = _store_deadline(coordinator, timeout_s)
    try:
        with deadline:
            client = TCPStore(
                coordinator.host, coordinator.port, is_master=False, wait_for_workers=False, timeout=join_timeout
            )
        if deadline.cut:  # made all the same, on a connection cut at the deadline: unusable
            raise _join_unanswered(coordinator, timeout_s, epoch)
        store = PrefixStore(f"tidal/epoch/{epoch}", client)
        process_group = _new_backend(store, group_rank, size, use_nccl, join_timeout, ordered[group_rank].host)
    except GroupBrokenError:
        raise
    except Exception as err:
        if deadline.cut:  # the coordinator is the peer that failed: no probe needed to name it
            raise _join_unanswered(coordinator, timeout_s, epoch) from err
        raise GroupBrokenError(f"could not join: {_first_line(err)}", _gone_peer(ordered, my_rank), epoch) from err
    wire = device if use_nccl else torch.device("cpu")
    store_link = _StoreLink(coordinator, deadline.opened())
    return EpochGroup(epoch, ordered, my_rank, store_link, wire, process_group, store, collective_timeout_s)


@dataclass(frozen=True)
class _StoreLink:
    """The epoch's store: the member hosting it, and this process's connections to it (its client's, made in the
    join), the only ones a deadline on its reads may cut."""

    coordinator: EpochMember
    connections: frozenset[str]


def _store_deadline(
    coordinator: EpochMember, timeout_s: float, only: frozenset[str] | None = None
) -> RendezvousDeadline:
    """Cuts the block's connections to the coordinator's endpoint (or `only` those) if it outlasts `timeout_s` and
    the grace."""
    return RendezvousDeadline(coordinator.host, coordinator.port, timeout_s, only)


def _join_unanswered(coordinator: EpochMember, timeout_s: float, epoch: int) -> GroupBrokenError:
    return GroupBrokenError(f"could not join: {_no_answer(coordinator, timeout_s)}", coordinator.rank, epoch)


def _no_answer(coordinator: EpochMember, timeout_s: float) -> str:
    return (
        f"coordinator rank {coordinator.rank} at {coordinator.address} did not answer within {timeout_s:g}s (its "
        "group endpoint accepts connections but its store does not answer: is the rank frozen?)"
    )


def _new_backend(
    store: Store, group_rank: int, size: int, use_nccl: bool, join_timeout: datetime.timedelta, my_host: str
) -> _Backend:
    if use_nccl:
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = join_timeout
        return cast(_Backend, dist.ProcessGroupNCCL(store, group_rank, size, nccl_options))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = join_timeout  # connecting the full mesh waits for the last member to arrive
    # Bound to this rank's own group address: on a node whose pods each have their own IP, the default (the
    # host name's address) would be shared by all of them.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=my_host)]
    return cast(_Backend, dist.ProcessGroupGloo(store, group_rank, size, options))


class _Work(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...


class _Backend(Protocol):
    """What is used of a gloo or NCCL process group."""

    def allgather(self, output: list[list[torch.Tensor]], input: list[torch.Tensor]) -> _Work: ...

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
        options: dist.AllToAllOptions,
    ) -> _Work: ...  # fmt: skip

    def abort(self) -> None: ...


class EpochGroup:
    """The collectives of one epoch (see `tidal.worker.layers.expert_parallel.ExpertComm`)."""

    def __init__(
        self,
        epoch: int,
        members: Sequence[EpochMember],
        my_rank: int,
        store_link: _StoreLink,
        wire: torch.device,
        backend: _Backend,
        store: Store,
        collective_timeout_s: float,
    ) -> None:
        self.epoch = epoch
        self.member_list = list(members)
        self.members: tuple[int, ...] = tuple(m.rank for m in members)
        self.my_rank = my_rank
        self.coordinator = store_link.coordinator  # hosts the epoch's store
        self._store_connections = store_link.connections
        self.size = len(self.members)
        self.group_rank = self.members.index(my_rank)
        self.wire = wire  # where exchanged tensors must be (host memory for gloo); `.to()` is free when they are
        self._backend: _Backend | None = backend
        self._store = store
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.collective_timeout_s = collective_timeout_s

    # ----- collectives -----
    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every member's `values` (same length everywhere), in member order: the step header."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.wire)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait("all_gather", lambda b: b.allgather([gathered], [mine]))
        return [t.tolist() for t in gathered]

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [size] int64 (rows for each member) -> [size] int64 (rows from each member)."""
        sent = counts.to(self.wire)
        received = torch.empty_like(sent)
        self._wait("all_to_all_counts", lambda b: b.alltoall_base(received, sent, [], [], dist.AllToAllOptions()))
        return received.to(counts.device)

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """send [sum(send_counts), ...] rows for each member in member order -> [sum(recv_counts), ...]."""
        sent = send.to(self.wire).contiguous()
        received = sent.new_empty((sum(recv_counts), *send.shape[1:]))
        self._wait(
            "all_to_all",
            lambda b: b.alltoall_base(received, sent, recv_counts, send_counts, dist.AllToAllOptions()),
        )
        return received.to(send.device)

    # ----- the epoch's store -----
    def publish(self, key: str, value: bytes) -> None:
        """Put `value` (UTF-8 text) under `key` in the epoch's store, for the other members to `fetch`."""
        try:
            self._store.set(key, value.decode())  # the JSON the coordinator publishes
        except Exception as err:
            raise self._broken(f"publishing {key!r} failed: {_first_line(err)}") from err

    def fetch(self, key: str, timeout_s: float) -> bytes:
        """The value another member published under `key`, waiting up to `timeout_s` for it."""
        deadline = _store_deadline(self.coordinator, timeout_s, self._store_connections)
        try:
            with deadline:
                self._store.wait([key], datetime.timedelta(seconds=timeout_s))
                value = bytes(self._store.get(key))
        except Exception as err:
            if deadline.cut:
                raise self._unanswered(key, timeout_s) from err
            raise self._broken(f"no {key!r} within {timeout_s:g}s: {_first_line(err)}") from err
        if deadline.cut:  # read all the same, but the store's connection was cut: the epoch's store is gone
            raise self._unanswered(key, timeout_s)
        return value

    def close(self) -> None:
        """Give the group up (it broke, or the next epoch replaced it); never blocks on a dead or frozen peer."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.abort()
            except Exception as err:  # best effort: the group is unusable either way
                log.debug("aborting epoch %d's group: %s", self.epoch, err)

    # ----- failures -----
    def _wait(self, op: str, start: Callable[[_Backend], _Work]) -> None:
        backend = self._backend
        if backend is None:
            raise GroupBrokenError(f"{op} on a closed group", epoch=self.epoch)
        try:
            start(backend).wait(self._timeout)
        except Exception as err:
            raise self._broken(f"{op} failed: {_first_line(err)}") from err

    def _broken(self, why: str) -> GroupBrokenError:
        """The error for a failed collective, at once: finding the peer to blame takes a probe (up to its timeout
        for a frozen peer), which `find_culprit` does off the step path."""
        return GroupBrokenError(why, None, self.epoch)

    def _unanswered(self, key: str, timeout_s: float) -> GroupBrokenError:
        why = f"no {key!r} within {timeout_s:g}s: {_no_answer(self.coordinator, timeout_s)}"
        return GroupBrokenError(why, self.coordinator.rank, self.epoch)

    def find_culprit(self) -> tuple[int, str] | None:
        """Probe every peer's endpoint: (rank, why) of the first one that is gone or frozen, None if all answer.
        Blocks up to the probe timeout; call it from a thread of its own."""
        gone = probe_peers(self.member_list, self.my_rank, min(_PROBE_TIMEOUT_S, self.collective_timeout_s))
        if not gone:
            return None
        peer = min(gone)
        return peer, gone[peer]


def _gone_peer(members: Sequence[EpochMember], my_rank: int) -> int | None:
    gone = probe_peers(members, my_rank, _PROBE_TIMEOUT_S)
    return min(gone) if gone else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]
