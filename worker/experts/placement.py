"""Plan an epoch's expert location map from the ranks present, the previous map and observed load (pure).

Rules:
- Refusal: the present ranks have P * S slots; fewer than E and some expert would have no copy, so the plan is
  refused with `NotEnoughSlotsError`, naming how many slots are missing (the worker refuses the epoch and keeps its
  old state: a model is never served with an expert silently missing).
- Whole group (every rank of the group present): the full layout (`full_layout`), whatever the previous map. A
  complete group's layout depends on its shape and load only, so it never drifts with the history of failures: a
  rejoin, a fresh start and a resize to the same size all arrive at the same map. The cost stays small: the epoch is
  ready when its slowest rank is, a joining rank loads all S of its slots, and a rank that stays keeps its first
  copies (they are nested across group sizes, see `full_layout`). Growing by one rank, a rank that stays loads at
  most its redundant slots (< S), so it takes no longer than loading the new rank; shrinking by one, it loads at most
  the leaving rank's first copies it inherits and its redundant slots.
- Degraded group (some rank absent): as few changes as possible, since the group serves again only once every rank
  has installed the map. Every surviving rank keeps what it held in the previous map (with no previous map: what the
  full layout gives it); a rank new to the group since the previous map gets its slots of the full layout. Experts
  left with no copy are then loaded, the most loaded first, each onto the survivor with the fewest loads so far
  (ties: the most room, then the lowest rank), into an empty slot or else in place of the copy of an expert that
  has other copies left and carries the least load per copy once it is gone (without load: the one with the most
  copies; ties: not a first copy of the full layout, then the lowest slot). Nothing else moves: redundancy is
  rebuilt by the next whole-group epoch, not on the recovery path.
- Resize: the group size is the shape's, the slots per rank stay (fixed for a worker's life). A previous map of
  another group size is repaired like one of the same size (its ranks past the new size are simply absent), and a
  whole group of the new size gets its full layout, whose first copies are nested across group sizes.
- Deterministic: the same inputs give the same plan.
The plan also says, per rank, what to load, move and drop (`changes`), and which experts no present rank held
before (`missing_experts`: the degraded experts the epoch reloads from the checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.worker.experts.changes import RankChanges, rank_changes
from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, Slots
from tidal.worker.experts.full_layout import check_load, full_layout, home_experts


@dataclass(frozen=True)
class PlacementPlan:
    expert_map: ExpertMap
    changes: tuple[RankChanges, ...]  # one per present rank, by rank
    missing_experts: tuple[int, ...]  # held by no present rank before this epoch (empty without a previous map)

    def changes_of(self, rank: int) -> RankChanges:
        for changes in self.changes:
            if changes.rank == rank:
                return changes
        raise KeyError(f"rank {rank} is not in this plan (present: {list(self.expert_map.present_ranks)})")


def plan_placement(
    shape: GroupShape,
    present_ranks: Sequence[int],
    previous: ExpertMap | None = None,
    load: Sequence[float] | None = None,
) -> PlacementPlan:
    """The map of the epoch whose members are `present_ranks`, by the module's rules."""
    present = _checked_ranks(shape, present_ranks)
    if previous is not None and previous.num_experts != shape.num_experts:
        raise ExpertMapError(
            [f"the previous map has {previous.num_experts} experts, this group has {shape.num_experts}"]
        )
    loads = check_load(load, shape.num_experts)
    target = full_layout(shape, loads)
    whole = len(present) == shape.group_size
    expert_map = target if whole else _repaired(shape, present, previous, target, loads)
    missing: tuple[int, ...] = ()
    if previous is not None:
        before = {e for rank in present for e in _previous_slots(previous, rank) or () if e is not None}
        missing = tuple(e for e in range(shape.num_experts) if e not in before)
    return PlacementPlan(expert_map, rank_changes(previous, expert_map), missing)


def _checked_ranks(shape: GroupShape, present_ranks: Sequence[int]) -> list[int]:
    present = sorted(present_ranks)
    problems = []
    if not present:
        problems.append("no rank is present")
    if len(set(present)) != len(present):
        problems.append(f"present ranks {present} repeat a rank")
    if outside := [rank for rank in present if not 0 <= rank < shape.group_size]:
        problems.append(f"ranks {outside} are outside the group of {shape.group_size}")
    if problems:
        raise ExpertMapError(problems)
    shape.check_room(present)
    return present


def _previous_slots(previous: ExpertMap | None, rank: int) -> Slots | None:
    if previous is None or rank >= previous.group_size:
        return None
    return previous.slots[rank]


def _fitted(slots: Slots, slots_per_rank: int) -> list[int | None]:
    """A previous map's slots on this shape's slot count: experts keep their slot where it still exists; those past
    the end move into empty slots while there are any (the rest are dropped, and reloaded elsewhere if needed)."""
    fitted = list(slots[:slots_per_rank]) + [None] * (slots_per_rank - len(slots))
    for expert in slots[slots_per_rank:]:
        if expert is not None and None in fitted:
            fitted[fitted.index(None)] = expert
    return fitted


def _repaired(
    shape: GroupShape,
    present: list[int],
    previous: ExpertMap | None,
    target: ExpertMap,
    loads: list[float] | None,
) -> ExpertMap:
    held: dict[int, list[int | None]] = {}
    loaded = dict.fromkeys(present, 0)  # experts each rank reads from the checkpoint this epoch
    for rank in present:
        before = _previous_slots(previous, rank) if previous is not None else target.rank_slots(rank)
        if before is None:  # new to the group: it loads its whole share of the full layout anyway
            held[rank] = list(target.rank_slots(rank))
            loaded[rank] = sum(e is not None for e in held[rank])
        else:
            held[rank] = _fitted(before, shape.slots_per_rank)
    copies = [0] * shape.num_experts
    for slots in held.values():
        for expert in slots:
            if expert is not None:
                copies[expert] += 1
    weight = loads if loads is not None else [1.0] * shape.num_experts
    homes_on = [len(home) for home in home_experts(shape.num_experts, shape.group_size)]

    def room(rank: int) -> list[int]:
        """Slots of `rank` that may take a missing expert: empty ones, or copies of experts with other copies."""
        return [i for i, e in enumerate(held[rank]) if e is None or copies[e] > 1]

    def giving_up(rank: int, index: int) -> tuple[int, float, bool, int]:
        """Order of the slots to give up: empty ones, then the least load per copy left, then not a first copy of
        the full layout (which the next whole-group epoch would reload), then the lowest slot."""
        expert = held[rank][index]
        if expert is None:
            return (0, 0.0, False, index)
        is_home = index < homes_on[rank] and target.rank_slots(rank)[index] == expert
        return (1, weight[expert] / (copies[expert] - 1), is_home, index)

    uncovered = sorted((e for e in range(shape.num_experts) if copies[e] == 0), key=lambda e: (-weight[e], e))
    for expert in uncovered:
        candidates = [rank for rank in present if room(rank)]
        if not candidates:  # impossible while P * S >= E (checked): some slot is empty or holds a spare copy
            raise RuntimeError(f"no slot left for expert {expert} in {held}")
        rank = min(candidates, key=lambda r: (loaded[r], -len(room(r)), r))
        index = min(room(rank), key=lambda i: giving_up(rank, i))
        dropped = held[rank][index]
        if dropped is not None:
            copies[dropped] -= 1
        held[rank][index] = expert
        copies[expert] += 1
        loaded[rank] += 1
    repaired = tuple(tuple(held[rank]) if rank in held else None for rank in range(shape.group_size))
    return ExpertMap(shape.num_experts, shape.group_size, shape.slots_per_rank, repaired)
