"""The worker's view of its group's membership, set by `POST /group/reconfigure` one epoch at a time (pure).

The operator numbers every membership of a replica's group with an epoch that only grows: all ranks loaded ->
epoch e with all of them; a rank lost -> e+1 with the survivors; the rank back and loaded -> e+2 with all again. A
worker therefore applies an epoch only if it is newer than the last one it applied; the same epoch again with the
same membership is a retry and changes nothing; anything older, or the same epoch with another membership, comes
from a stale caller and is refused. The membership is kept in memory only: a restarted worker starts at epoch 0,
and the operator sends it the next epoch once it is loaded.

The group's size belongs to each epoch (`group_size`; the worker's start world_size until one says otherwise), so a
running group grows and shrinks by epochs: every member is below the epoch's size, and the group is formed when the
members are all its ranks. A worker started alone (world_size 1) was built without expert parallelism and stays a
group of one.

It lives with the lifecycle because the lifecycle manager holds it (applies it, reports it in `/state`) and its
refusals are lifecycle errors; nothing here touches HTTP, the engine or the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.contract.control_api import GroupReconfigureRequest
from tidal.worker.lifecycle.errors import BadRequestError, StaleEpochError


@dataclass(frozen=True)
class Membership:
    epoch: int
    members: frozenset[tuple[int, str]]  # (rank, address)
    coordinator_rank: int
    group_size: int

    @property
    def ranks(self) -> list[int]:
        return sorted(rank for rank, _ in self.members)

    @classmethod
    def of(cls, request: GroupReconfigureRequest, group_size: int) -> Membership:
        members = frozenset((m.rank, m.address) for m in request.members)
        return cls(request.epoch, members, request.coordinator_rank, group_size)


class GroupMembership:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size  # the size the worker was started for
        self.current: Membership | None = None

    @property
    def epoch(self) -> int:
        return self.current.epoch if self.current is not None else 0

    @property
    def coordinator_rank(self) -> int:
        return self.current.coordinator_rank if self.current is not None else 0

    @property
    def group_size(self) -> int:
        """The current epoch's group size; the start world_size before any epoch."""
        return self.current.group_size if self.current is not None else self.world_size

    def group_size_of(self, request: GroupReconfigureRequest) -> int:
        """The group size `request` asks for (its own, or by default the start world_size)."""
        return request.group_size if request.group_size is not None else self.world_size

    @property
    def is_formed(self) -> bool:
        """A lone worker is a group by itself; otherwise every rank of the epoch's group size must be a member (a
        group of the survivors of a failure is applied, but not formed: it serves degraded until the lost rank is
        back)."""
        if self.current is None:
            return self.world_size == 1
        return self.current.ranks == list(range(self.current.group_size))

    def apply(self, request: GroupReconfigureRequest) -> bool:
        """Make `request` the membership. -> False when it is the one applied already (a retry).
        BadRequestError: it does not fit this worker; StaleEpochError: an older epoch, or this one with others."""
        if not self.check(request):
            return False
        self.commit(request)
        return True

    def commit(self, request: GroupReconfigureRequest) -> None:
        """Make `request` the membership (after `check` said it is new and the epoch was joined)."""
        self.current = Membership.of(request, self.group_size_of(request))

    def check(self, request: GroupReconfigureRequest) -> bool:
        """Whether `request` is a new membership to apply (False: the one applied already, a retry); refuses what
        `apply` refuses, and changes nothing."""
        proposed = Membership.of(request, self.group_size_of(request))
        if self.world_size == 1 and proposed.group_size > 1:
            raise BadRequestError(
                f"this worker was started alone (world_size 1), without expert parallelism: it cannot be a member of "
                f"a group of {proposed.group_size}; start it for the group's size"
            )
        outside = [rank for rank in proposed.ranks if rank >= proposed.group_size]
        if outside:
            where = "the epoch's group_size" if request.group_size is not None else "this worker's group of world_size"
            raise BadRequestError(f"member ranks {outside} are outside {where} {proposed.group_size}")
        if self.rank not in proposed.ranks:
            raise BadRequestError(
                f"this worker is rank {self.rank}, which is not among the members {proposed.ranks} of epoch "
                f"{proposed.epoch}; a rank left out of a membership is not sent it"
            )
        current = self.current
        if current is not None and proposed.epoch == current.epoch:
            if proposed == current:
                return False
            raise StaleEpochError(
                f"epoch {proposed.epoch} was already applied with members {current.ranks}, coordinator "
                f"{current.coordinator_rank} and group_size {current.group_size}; a new membership needs a new epoch "
                f"(> {current.epoch})"
            )
        if current is not None and proposed.epoch < current.epoch:
            raise StaleEpochError(
                f"epoch {proposed.epoch} is older than epoch {current.epoch}, applied already; nothing changed"
            )
        return True
