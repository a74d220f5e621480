"""The one error of an expert-parallel group's communication: the group of this epoch cannot be used any more."""

from __future__ import annotations


class GroupBrokenError(RuntimeError):
    """A collective of the epoch's group failed or missed its deadline, or the epoch could not be joined. `peer_rank`
    names the peer found gone or frozen when one was found (probing every peer's group endpoint)."""

    def __init__(self, reason: str, peer_rank: int | None = None, epoch: int = 0) -> None:
        super().__init__(f"epoch {epoch}: {reason}")
        self.reason = reason
        self.peer_rank = peer_rank
        self.epoch = epoch

    def __reduce__(self) -> tuple[type[GroupBrokenError], tuple[str, int | None, int]]:
        return (GroupBrokenError, (self.reason, self.peer_rank, self.epoch))  # keeps the fields across processes
