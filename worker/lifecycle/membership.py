"""The worker's view of its group's membership, set by `POST /group/reconfigure` one epoch at a time (pure).

The operator numbers every membership of a replica's group with an epoch that only grows: all ranks loaded ->
epoch e with all of them; a rank lost -> e+1 with the survivors; the rank back and loaded -> e+2 with all again. A
worker therefore applies an epoch only if it is newer than the last one it applied; the same epoch again with the
same membership is a retry and changes nothing; anything older, or the same epoch with another membership, comes
from a stale caller and is refused. The membership is kept in memory only: a restarted worker starts at epoch 0,
and the operator sends it the next epoch once it is loaded.

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

    @property
    def ranks(self) -> list[int]:
        return sorted(rank for rank, _ in self.members)

    @classmethod
    def of(cls, request: GroupReconfigureRequest) -> Membership:
        members = frozenset((m.rank, m.address) for m in request.members)
        return cls(request.epoch, members, request.coordinator_rank)


class GroupMembership:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.current: Membership | None = None

    @property
    def epoch(self) -> int:
        return self.current.epoch if self.current is not None else 0

    @property
    def coordinator_rank(self) -> int:
        return self.current.coordinator_rank if self.current is not None else 0

    @property
    def is_formed(self) -> bool:
        """A lone rank is a group by itself; otherwise every rank of the world must be a member (a group of the
        survivors of a failure is applied, but not formed: it serves degraded until the lost rank is back)."""
        if self.world_size == 1:
            return True
        return self.current is not None and self.current.ranks == list(range(self.world_size))

    def apply(self, request: GroupReconfigureRequest) -> bool:
        """Make `request` the membership. -> False when it is the one applied already (a retry).
        BadRequestError: it does not fit this worker; StaleEpochError: an older epoch, or this one with others."""
        if not self.check(request):
            return False
        self.commit(request)
        return True

    def commit(self, request: GroupReconfigureRequest) -> None:
        """Make `request` the membership (after `check` said it is new and the epoch was joined)."""
        self.current = Membership.of(request)

    def check(self, request: GroupReconfigureRequest) -> bool:
        """Whether `request` is a new membership to apply (False: the one applied already, a retry); refuses what
        `apply` refuses, and changes nothing."""
        proposed = Membership.of(request)
        outside = [rank for rank in proposed.ranks if rank >= self.world_size]
        if outside:
            raise BadRequestError(
                f"member ranks {outside} are outside this worker's group of world_size {self.world_size}"
            )
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
                f"epoch {proposed.epoch} was already applied with members {current.ranks} and coordinator "
                f"{current.coordinator_rank}; a new membership needs a new epoch (> {current.epoch})"
            )
        if current is not None and proposed.epoch < current.epoch:
            raise StaleEpochError(
                f"epoch {proposed.epoch} is older than epoch {current.epoch}, applied already; nothing changed"
            )
        return True
