"""What one rank must do to go from its slots in one epoch's map to its slots in the next (pure).

A rank reads from the checkpoint, by tensor name, every expert it holds now and did not hold before (`loads`); an
expert it keeps but in another slot is copied inside the rank (`moves`, which together form a permutation of slots,
so a worker applies them through a temporary copy or in an order that reads each slot before it is overwritten);
an expert it no longer holds may be dropped (`drops`). A rank absent from the previous map (a new or replaced rank,
or no previous map at all) loads everything it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, Slots


class SlotLoad(NamedTuple):
    slot: int
    expert: int


class SlotMove(NamedTuple):
    expert: int
    from_slot: int
    to_slot: int


@dataclass(frozen=True)
class RankChanges:
    rank: int
    loads: tuple[SlotLoad, ...]  # read from the checkpoint into the slot
    moves: tuple[SlotMove, ...]  # kept, but in another slot of the same rank
    drops: tuple[int, ...]  # held before, not any more

    @property
    def is_unchanged(self) -> bool:
        return not (self.loads or self.moves or self.drops)

    @property
    def loaded_experts(self) -> tuple[int, ...]:
        return tuple(load.expert for load in self.loads)


def rank_changes(previous: ExpertMap | None, new: ExpertMap) -> tuple[RankChanges, ...]:
    """The changes of every rank present in `new`, by rank; `previous` None means every rank starts empty."""
    if previous is not None and previous.num_experts != new.num_experts:
        raise ExpertMapError(
            [f"the previous map has {previous.num_experts} experts, the new one {new.num_experts}: no common ids"]
        )
    return tuple(_changes(rank, _slots_before(previous, rank), new.rank_slots(rank)) for rank in new.present_ranks)


def _slots_before(previous: ExpertMap | None, rank: int) -> Slots:
    if previous is None or rank >= previous.group_size:
        return ()
    return previous.slots[rank] or ()


def _changes(rank: int, before: Slots, after: Slots) -> RankChanges:
    was_at = {expert: slot for slot, expert in enumerate(before) if expert is not None}
    now_at = {expert: slot for slot, expert in enumerate(after) if expert is not None}
    loads = tuple(SlotLoad(slot, expert) for expert, slot in now_at.items() if expert not in was_at)
    moves = tuple(
        SlotMove(expert, was_at[expert], slot)
        for expert, slot in now_at.items()
        if expert in was_at and was_at[expert] != slot
    )
    drops = tuple(sorted(expert for expert in was_at if expert not in now_at))
    return RankChanges(rank, tuple(sorted(loads)), tuple(sorted(moves, key=lambda m: m.to_slot)), drops)
