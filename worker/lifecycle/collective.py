"""Receiving weights from a trainer's broadcast over a process group made for this one transfer.

The trainer is rank 0 and hosts the rendezvous store at (address, port); each worker joins with the rank and world
size it was given, receives the named tensors in the announced order, and leaves. The group is private (not
torch.distributed's default group), so it never disturbs any other group the worker belongs to. gloo moves CPU
tensors straight into the host buffer; NCCL receives on the GPU, one tensor at a time, then copies to the host.

`send_weights` is the trainer's side, for trainers and tests.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from tidal.worker.group.rendezvous_deadline import RendezvousDeadline
from tidal.worker.lifecycle.errors import CollectiveError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store, Work

log = logging.getLogger(__name__)


class BroadcastGroup(Protocol):
    """What this module needs of a backend: torch's stubs leave `broadcast` off the backend classes that have it."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Work: ...


def _local_address_towards(address: str, port: int) -> str:
    """The address of the interface that reaches `address` (what gloo must bind to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, port))  # UDP: no packet is sent, only a route is chosen
        local: str = s.getsockname()[0]
        return local


def join_group(address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> BroadcastGroup:
    """Join (rank 0: host) the trainer's group; CollectiveError when the rendezvous or the group fails, or the
    rendezvous does not answer within `timeout_s` (nothing of the attempt is left running then)."""
    failed = f"cannot join the trainer's group at {address}:{port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    # The store client's construction (connect, then a ping with no deadline of its own) is held to the deadline;
    # the backend's setup is not: gloo waits on each member with its own timeout, so workers arriving one after
    # another may take longer than one timeout in all while nothing is wrong.
    deadline = RendezvousDeadline(address, port, timeout_s)
    try:
        with deadline:
            store = _store_client(address, port, rank, world_size, timeout)
        if deadline.cut:  # made all the same, on a connection cut at the deadline: unusable
            raise CollectiveError(f"{failed}: {_no_answer(timeout_s)}")
        return _group_on(store, address, port, rank, world_size, backend, timeout)
    except (RuntimeError, OSError) as err:  # torch's DistError is a RuntimeError; an unknown host an OSError
        raise CollectiveError(f"{failed}: {_no_answer(timeout_s) if deadline.cut else err}") from err


def _no_answer(timeout_s: float) -> str:
    return (
        f"its rendezvous did not answer within {timeout_s:g}s (the port accepts connections but no store answers "
        "there: is the trainer frozen, or is this not its rendezvous port?)"
    )


def _store_client(address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> Store:
    # Where torch defines it (torch.distributed re-exports it without declaring so, which a type checker refuses);
    # imported here so that a torch built without distributed still imports this module.
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)


def _group_on(
    store: Store, address: str, port: int, rank: int, world_size: int, backend: str, timeout: datetime.timedelta
) -> BroadcastGroup:
    if backend == "gloo":
        # The stub omits the options class the constructor takes (private in torch's bindings, public in use).
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(address, port))]
        return cast(BroadcastGroup, dist.ProcessGroupGloo(store, rank, world_size, options))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return cast(BroadcastGroup, dist.ProcessGroupNCCL(store, rank, world_size, options))


def leave_group(group: BroadcastGroup) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except RuntimeError as err:  # leaving must not fail an update that already succeeded
            log.warning("leaving the weights group: %s", err)


def receive_into(group: BroadcastGroup, destinations: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> int:
    """Receive one broadcast from rank 0 per destination, in order. -> bytes received."""
    num_bytes = 0
    for name, dest in destinations:
        target = dest if device.type == "cpu" else torch.empty(dest.shape, dtype=dest.dtype, device=device)
        try:
            group.broadcast([target], _root0()).wait()
        except RuntimeError as err:
            raise CollectiveError(f"receiving {name} failed: {err}") from err
        if target is not dest:
            dest.copy_(target)
        num_bytes += dest.numel() * dest.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return num_bytes


def _root0() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def send_weights(
    address: str,
    port: int,
    world_size: int,
    tensors: list[tuple[str, torch.Tensor]],
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> None:
    """The trainer's side: host the rendezvous as rank 0 and broadcast `tensors` in order (the same order and
    specs as the `tensors` list of the workers' `POST /weights/collective`)."""
    group = join_group(address, port, 0, world_size, backend, timeout_s)
    try:
        for _, tensor in tensors:
            group.broadcast([tensor.contiguous()], _root0()).wait()
    finally:
        leave_group(group)
