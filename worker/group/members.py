"""An epoch's member as the group layer sees it: a global rank and its group endpoint's address."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochMember:
    rank: int
    address: str  # host:port of the member's group endpoint

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])
