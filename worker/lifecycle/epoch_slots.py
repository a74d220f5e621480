"""Every member of an epoch must have the same number of expert slots per rank; this checks it at the join.

The slot count is fixed for a worker's life (its expert stacks are allocated once), while the group's size changes
by epochs. A rank started for a resized group derives another count from its own world_size unless it is given the
running members' (`--expert-slots-per-rank`), and a map has one count for every rank, so a member with another one
cannot serve in the epoch. Each member publishes its count in the epoch's store right after the rendezvous and reads
everyone's; on a difference every member refuses the epoch at once with the same message, before any map is planned
or any expert read, so nobody waits for a switch that will not come and the previous epoch keeps serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from tidal.worker.lifecycle.errors import ExpertsUnavailableError

_KEY = "slots_per_rank/{rank}"


class EpochStore(Protocol):
    """The epoch's store as its group offers it (tidal.worker.group.EpochGroup)."""

    def publish(self, key: str, value: bytes) -> None: ...

    def fetch(self, key: str, timeout_s: float) -> bytes: ...


def agree_on_slots(
    store: EpochStore,
    epoch: int,
    members: Sequence[int],
    my_rank: int,
    my_slots: int,
    coordinator_rank: int,
    timeout_s: float,
) -> None:
    """Publish this rank's slot count, read every member's; ExpertsUnavailableError when they differ. A member that
    never publishes makes `fetch` raise GroupBrokenError (the caller's unreachable group)."""
    store.publish(_KEY.format(rank=my_rank), str(my_slots).encode())
    counts = {my_rank: my_slots}
    for rank in members:
        if rank != my_rank:
            counts[rank] = int(store.fetch(_KEY.format(rank=rank), timeout_s))
    problem = slot_count_mismatch(counts, coordinator_rank)
    if problem is not None:
        raise ExpertsUnavailableError(f"epoch {epoch} refused: {problem}; the previous epoch is kept")


def slot_count_mismatch(counts: Mapping[int, int], coordinator_rank: int) -> str | None:
    """What is wrong when the members (rank -> expert slots per rank) do not all have the same count; None if they
    do. The coordinator's count is named as the one to start a joining rank with: it is a rank that served before."""
    by_count: dict[int, list[int]] = {}
    for rank, count in sorted(counts.items()):
        by_count.setdefault(count, []).append(rank)
    if len(by_count) <= 1:
        return None
    groups = ", ".join(f"ranks {ranks} have {count}" for count, ranks in sorted(by_count.items(), key=lambda i: i[1]))
    expected = counts[coordinator_rank]
    return (
        f"the members' expert slots per rank differ ({groups}); every member of an epoch needs the same count, so "
        f"start a joining rank with --expert-slots-per-rank {expected} (the coordinator's, rank {coordinator_rank})"
    )
