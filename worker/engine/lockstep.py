"""What the ranks of an expert-parallel group tell each other before every step, and what they decide from it (pure).

Every rank runs its own scheduler on its own requests, but each MoE layer is a collective: the ranks must run the
same number of forward passes, so they step in lockstep. Before each step every rank contributes a `StepHeader` to
one small all-gather; all ranks then see the same headers and take the same `StepDecision`:
- step when some rank has work, no rank is paused (held for a sleep or a weight update) and all serve one weights
  version (a request must never be answered by a mix of two versions' experts); a rank without work of its own then
  runs an empty step, which serves its peers' tokens for the experts it holds;
- switch to the next epoch, without stepping, once every rank of this group that is also a member of the next epoch
  has prepared it (joined its process group, staged its experts): so the ranks that stay leave the old group at the
  same step, and a rank that is not in the next epoch is simply left behind (its next collective fails);
- otherwise do nothing, and if no rank has work wait a little before the next header (an idle group does not spin).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class StepHeader(NamedTuple):
    has_work: bool  # requests of its own to run (or a step to redo)
    paused: bool  # held by the lifecycle: takes part in no step until released
    version_tag: int  # of the weights version it serves (`version_tag`)
    ready_epoch: int  # the next epoch it has prepared and is ready to switch to (0: none)

    def encode(self) -> list[int]:
        return [int(self.has_work), int(self.paused), self.version_tag, self.ready_epoch]

    @classmethod
    def decode(cls, values: Sequence[int]) -> StepHeader:
        has_work, paused, version_tag, ready_epoch = values
        return cls(bool(has_work), bool(paused), version_tag, ready_epoch)


def version_tag(version: str | None) -> int:
    """A small integer standing for a weights version in the header (a crc32: equal versions, equal tags)."""
    return zlib.crc32((version or "").encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class StepDecision:
    step: bool  # run one step (this rank's own batch, or an empty one)
    switch: bool  # switch to the prepared next epoch now (no step)
    group_idle: bool  # no rank has work: wait a little before the next header
    waiting_on: str | None = None  # why work waits (a paused rank, a version mismatch), for /state and logs


def decide(
    headers: Sequence[StepHeader],
    members: Sequence[int],
    next_epoch: int = 0,
    next_members: Sequence[int] = (),
) -> StepDecision:
    """The decision every rank takes from the same `headers` (one per member, in `members` order). `next_epoch`,
    `next_members`: the epoch this rank has prepared (0: none) and its members."""
    if next_epoch:
        staying = [h for rank, h in zip(members, headers, strict=True) if rank in next_members]
        if staying and all(h.ready_epoch == next_epoch for h in staying):
            return StepDecision(step=False, switch=True, group_idle=False)
    working = any(h.has_work for h in headers)
    if not working:
        return StepDecision(step=False, switch=False, group_idle=True)
    paused = [rank for rank, h in zip(members, headers, strict=True) if h.paused]
    if paused:
        return StepDecision(False, False, False, f"ranks {paused} are paused (sleep or weight update)")
    if len({h.version_tag for h in headers}) > 1:
        return StepDecision(False, False, False, "the ranks serve different weights versions")
    return StepDecision(step=True, switch=False, group_idle=False)
