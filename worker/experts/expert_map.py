"""An epoch's expert location map and its shape, with the JSON form it travels in and the checks that guard it.

A group of `group_size` ranks serves `num_experts` logical experts per MoE layer (the same for every MoE layer of a
model, so one map serves them all). Each rank has `slots_per_rank` physical slots (at start ceil(E / N) for an even
share plus R redundant ones; the count stays when the group is resized), and each slot holds one logical expert or
nothing. A map names, for every rank present in the epoch, what each of its slots holds; ranks absent from the
epoch have no slots. Every valid map gives each logical expert at least one copy and never two copies of one expert
to one rank (a second copy on the same rank would add no capacity and no fault tolerance).

JSON form (for `/group/reconfigure` and `/state`), compact and positional:
    {"num_experts": 8, "group_size": 4, "slots_per_rank": 3,
     "slots": [[0, 1, 4], null, [3, 7, 0], [2, 6, null]]}
`slots[r]` is rank r's slots, or null when rank r is not in the epoch. `ExpertMap.from_json` checks everything and
raises `ExpertMapError` listing every problem it found, so a bad map from outside is refused with a readable reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

Slots = tuple[int | None, ...]  # one rank's slots: the logical expert each holds, None for an empty slot


class ExpertMapError(ValueError):
    """A map, a shape or a planning input that cannot be used as it is; `problems` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class PhysicalSlot(NamedTuple):
    rank: int
    slot: int


class NotEnoughSlotsError(ExpertMapError):
    """The ranks present have too few slots for one copy of every expert."""

    def __init__(self, problems: list[str], missing_slots: int) -> None:
        super().__init__(problems)
        self.missing_slots = missing_slots


@dataclass(frozen=True)
class GroupShape:
    """What a placement is planned for: E experts over a group of N ranks with S slots each.

    S is fixed for a worker's life (its device buffers are stacked once), N is a property of each epoch: a group is
    resized by epochs with the same S (`resized`). `even_share` is the shape a group is started with: an even share
    ceil(E / N) plus R redundant slots per rank."""

    num_experts: int
    group_size: int
    slots_per_rank: int

    def __post_init__(self) -> None:
        problems = []
        if self.num_experts < 1:
            problems.append(f"num_experts must be at least 1, got {self.num_experts}")
        if self.group_size < 1:
            problems.append(f"group_size must be at least 1, got {self.group_size}")
        if self.slots_per_rank < 1:
            problems.append(f"slots_per_rank must be at least 1, got {self.slots_per_rank}")
        if problems:
            raise ExpertMapError(problems)

    @classmethod
    def even_share(cls, num_experts: int, group_size: int, redundant_slots_per_rank: int = 0) -> GroupShape:
        """ceil(E / N) + R slots per rank."""
        if redundant_slots_per_rank < 0:
            raise ExpertMapError([f"redundant_slots_per_rank must be at least 0, got {redundant_slots_per_rank}"])
        if group_size < 1:
            raise ExpertMapError([f"group_size must be at least 1, got {group_size}"])
        return cls(num_experts, group_size, -(-num_experts // group_size) + redundant_slots_per_rank)

    def resized(self, group_size: int) -> GroupShape:
        """The same experts and slots per rank over `group_size` ranks."""
        return GroupShape(self.num_experts, group_size, self.slots_per_rank)

    def check_room(self, ranks: Sequence[int]) -> None:
        """NotEnoughSlotsError unless `ranks` have a slot for one copy of every expert (P x S >= E)."""
        present = sorted(ranks)
        slots = len(present) * self.slots_per_rank
        if slots >= self.num_experts:
            return
        missing = self.num_experts - slots
        raise NotEnoughSlotsError(
            [
                f"ranks {present} have {len(present)} x {self.slots_per_rank} = {slots} expert slots for "
                f"{self.num_experts} experts: {missing} slot{'s' if missing > 1 else ''} missing, so some expert "
                f"would have no copy"
            ],
            missing,
        )


@dataclass(frozen=True)
class ExpertMap:
    """Which logical expert each slot of each present rank holds; valid by construction (see the module docstring)."""

    num_experts: int
    group_size: int
    slots_per_rank: int
    slots: tuple[Slots | None, ...]  # [group_size]: a present rank's slots, None for an absent rank

    def __post_init__(self) -> None:
        problems = _problems(self.num_experts, self.group_size, self.slots_per_rank, self.slots)
        if problems:
            raise ExpertMapError(problems)

    @property
    def present_ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, slots in enumerate(self.slots) if slots is not None)

    def rank_slots(self, rank: int) -> Slots:
        """Rank `rank`'s slots; KeyError when the rank is not in this map's epoch."""
        slots = self.slots[rank] if 0 <= rank < self.group_size else None
        if slots is None:
            raise KeyError(f"rank {rank} is not in this map (present: {list(self.present_ranks)})")
        return slots

    @cached_property
    def _copies(self) -> tuple[tuple[PhysicalSlot, ...], ...]:
        found: list[list[PhysicalSlot]] = [[] for _ in range(self.num_experts)]
        for rank, slots in enumerate(self.slots):
            for slot, expert in enumerate(slots or ()):
                if expert is not None:
                    found[expert].append(PhysicalSlot(rank, slot))
        return tuple(tuple(copies) for copies in found)

    def copies(self, expert: int) -> tuple[PhysicalSlot, ...]:
        """The physical copies of logical expert `expert`, by rank (at least one)."""
        return self._copies[expert]

    def to_json(self) -> dict[str, object]:
        return {
            "num_experts": self.num_experts,
            "group_size": self.group_size,
            "slots_per_rank": self.slots_per_rank,
            "slots": [None if slots is None else list(slots) for slots in self.slots],
        }

    @classmethod
    def from_json(cls, data: object) -> ExpertMap:
        """Read a map received from outside; ExpertMapError lists every problem (types first, then the rules)."""
        if not isinstance(data, dict):
            raise ExpertMapError([f"an expert map is a JSON object, got {type(data).__name__}"])
        problems = []
        expected = {"num_experts", "group_size", "slots_per_rank", "slots"}
        if unknown := sorted(str(key) for key in data.keys() - expected):
            problems.append(f"unknown fields {unknown}")
        if missing := sorted(expected - data.keys()):
            problems.append(f"missing fields {missing}")
        sizes: dict[str, int] = {}
        for name in ("num_experts", "group_size", "slots_per_rank"):
            value = data.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                sizes[name] = value
            elif name in data:
                problems.append(f"{name} must be an integer, got {value!r}")
        slots = _read_slots(data.get("slots"), problems) if "slots" in data else ()
        if problems:
            raise ExpertMapError(problems)
        return cls(sizes["num_experts"], sizes["group_size"], sizes["slots_per_rank"], slots)

    def check_fits(self, shape: GroupShape, members: list[int]) -> None:
        """ExpertMapError unless this map is for `shape` and has exactly the ranks `members` present: a worker calls
        this on the map of an epoch it is asked to apply, before touching anything."""
        problems = []
        mine = (self.num_experts, self.group_size, self.slots_per_rank)
        theirs = (shape.num_experts, shape.group_size, shape.slots_per_rank)
        for name, got, want in zip(("num_experts", "group_size", "slots_per_rank"), mine, theirs, strict=True):
            if got != want:
                problems.append(f"the map has {name} {got}, this group has {want}")
        if sorted(members) != list(self.present_ranks):
            problems.append(f"the map's ranks {list(self.present_ranks)} are not the epoch's members {sorted(members)}")
        if problems:
            raise ExpertMapError(problems)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_slots(value: object, problems: list[str]) -> tuple[Slots | None, ...]:
    """The JSON `slots` as tuples; type problems are appended (the rules are checked by ExpertMap itself)."""
    if not isinstance(value, list):
        problems.append(f"slots must be a list with one entry per rank, got {type(value).__name__}")
        return ()
    ranks: list[Slots | None] = []
    for rank, entry in enumerate(value):
        if entry is None:
            ranks.append(None)
        elif isinstance(entry, list) and all(e is None or _is_int(e) for e in entry):
            ranks.append(tuple(entry))
        else:
            problems.append(f"slots[{rank}] must be null or a list of expert ids and nulls, got {entry!r}")
            ranks.append(None)
    return tuple(ranks)


def _problems(num_experts: int, group_size: int, slots_per_rank: int, slots: tuple[Slots | None, ...]) -> list[str]:
    problems = []
    if num_experts < 1 or group_size < 1 or slots_per_rank < 1:
        problems.append(
            f"num_experts, group_size and slots_per_rank must be at least 1, got {num_experts}, {group_size}, "
            f"{slots_per_rank}"
        )
        return problems
    if len(slots) != group_size:
        problems.append(f"slots has {len(slots)} entries, one per rank of the group of {group_size} is needed")
    if all(rank_slots is None for rank_slots in slots):
        problems.append("no rank is present")
    held = [0] * num_experts
    for rank, rank_slots in enumerate(slots):
        if rank_slots is None:
            continue
        if len(rank_slots) != slots_per_rank:
            problems.append(f"rank {rank} has {len(rank_slots)} slots, not {slots_per_rank}")
        experts = [e for e in rank_slots if e is not None]
        if outside := sorted({e for e in experts if not 0 <= e < num_experts}):
            problems.append(f"rank {rank} holds experts {outside}, outside 0..{num_experts - 1}")
        if twice := sorted({e for e in experts if experts.count(e) > 1}):
            problems.append(f"rank {rank} holds experts {twice} more than once")
        for expert in set(experts):
            if 0 <= expert < num_experts:
                held[expert] += 1
    if uncovered := [expert for expert, count in enumerate(held) if count == 0]:
        more = f" (and {len(uncovered) - 16} more)" if len(uncovered) > 16 else ""
        problems.append(f"experts {uncovered[:16]}{more} have no copy on any present rank")
    return problems
