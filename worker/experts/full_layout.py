"""The layout of a whole group (every rank present), computed from its shape and, optionally, observed load alone.

Rules:
- First copies ("home" copies) are balanced: each rank holds floor(E / N) or ceil(E / N) of them, the lower ranks
  the larger share. They are built by growing the group one rank at a time from a single rank holding every expert:
  the rank added takes the highest-numbered surplus experts of the ranks before it. So the homes of N + 1 ranks are
  those of N ranks with only the new rank's share moved, and resizing a group by one rank moves no other first copy
  (each rank's homes of N + 1 ranks are a prefix of its homes of N, in the same slots). They depend on E and N
  only, not on S, so with a fixed S the layout exists for every N with N * S >= E (ceil(E / N) <= S then) and a
  rank that stays through a resize keeps its first copies; with N * S < E it is refused (`NotEnoughSlotsError`).
- The remaining N * S - E slots hold redundant copies, at most one copy of an expert per rank. Without load they go
  round-robin over the ranks' home lists (the first home expert of every rank, then the second of every rank, ...),
  so that every rank's experts are backed up alike and a lost rank leaves as few experts without a copy as possible.
  With load (tokens routed to each logical expert), each redundant copy goes to the expert with the most load per
  copy (ties: the fewest copies, then the round-robin order), so hot experts get several copies.
- A redundant copy goes to a rank with a free slot that does not hold that expert: with load, the one carrying the
  least load (each copy carrying its expert's load divided by its copies); then, or without load, the nearest rank
  after the expert's home, so that a rank's experts are backed up by its successors and a lost rank's load spreads
  over them. When every rank with room holds the expert already, redundant copies placed earlier are shifted along
  a chain of ranks to make room (breadth-first, shortest chain); an expert no chain can place gets no more copies.
- Slots: a rank's home experts first (ascending), then its redundant copies in the order they were placed; slots
  left over only when S exceeds E stay empty.
The result depends on nothing else (no history): a fresh start, a rejoin and a resize to the same N all give it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, Slots


def check_load(load: Sequence[float] | None, num_experts: int) -> list[float] | None:
    """The observed per-expert load as a list, or ExpertMapError when it is not one finite value >= 0 per expert."""
    if load is None:
        return None
    if len(load) != num_experts:
        raise ExpertMapError([f"load has {len(load)} values, one per expert ({num_experts}) is needed"])
    if bad := [i for i, value in enumerate(load) if not (math.isfinite(value) and value >= 0)]:
        raise ExpertMapError([f"load of experts {bad[:16]} is not a finite number >= 0"])
    return [float(value) for value in load]


def home_experts(num_experts: int, group_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's home (first-copy) experts, ascending; nested across group sizes (module docstring)."""
    homes: list[list[int]] = [list(range(num_experts))]
    for size in range(2, group_size + 1):
        share, extra = divmod(num_experts, size)
        arriving: list[int] = []
        for rank, held in enumerate(homes):
            surplus = len(held) - (share + (rank < extra))  # >= 0: a rank's share never grows with the group
            arriving.extend(held[len(held) - surplus :])
            del held[len(held) - surplus :]
        homes.append(sorted(arriving))
    return tuple(tuple(held) for held in homes)


def round_robin_order(homes: tuple[tuple[int, ...], ...]) -> list[int]:
    """Every expert once: the first home expert of each rank, then the second of each rank, ..."""
    depth = max(len(held) for held in homes)
    return [held[i] for i in range(depth) for held in homes if i < len(held)]


def full_layout(shape: GroupShape, load: Sequence[float] | None = None) -> ExpertMap:
    """The map of the whole group of `shape` (every rank present), by the module's rules."""
    shape.check_room(range(shape.group_size))
    loads = check_load(load, shape.num_experts)
    homes = home_experts(shape.num_experts, shape.group_size)
    home_of = {expert: rank for rank, held in enumerate(homes) for expert in held}
    order = round_robin_order(homes)
    position = {expert: i for i, expert in enumerate(order)}
    slots = [list(held) for held in homes]
    counts = [1] * shape.num_experts
    # Priority of the next redundant copy: the most load per copy, then the fewest copies, then the round-robin
    # order (so no load, or equal loads, is round-robin). An expert no rank can take another copy of drops out.
    weight = loads if loads is not None else [0.0] * shape.num_experts
    heap = [(-weight[e], 1, position[e], e) for e in range(shape.num_experts)]
    heapq.heapify(heap)
    spare = shape.group_size * shape.slots_per_rank - shape.num_experts
    while spare > 0 and heap:
        _, _, _, expert = heapq.heappop(heap)
        if not _place_copy(shape, slots, homes, counts, loads, expert, home_of[expert]):
            continue
        counts[expert] += 1
        spare -= 1
        if counts[expert] < shape.group_size:
            heapq.heappush(heap, (-weight[expert] / counts[expert], counts[expert], position[expert], expert))
    return ExpertMap(
        shape.num_experts,
        shape.group_size,
        shape.slots_per_rank,
        tuple(_padded(held, shape.slots_per_rank) for held in slots),
    )


def _place_copy(
    shape: GroupShape,
    slots: list[list[int]],
    homes: tuple[tuple[int, ...], ...],
    counts: list[int],
    loads: list[float] | None,
    expert: int,
    home: int,
) -> bool:
    """Put one more copy of `expert` on a rank with a free slot, else make room by shifting other redundant copies
    along a chain of ranks; -> False when no rank can take it."""
    capacity = shape.slots_per_rank
    free = [rank for rank, held in enumerate(slots) if len(held) < capacity and expert not in held]
    if free:

        def preference(rank: int) -> tuple[float, int]:
            rank_load = 0.0 if loads is None else sum(loads[e] / counts[e] for e in slots[rank])
            return (rank_load, (rank - home) % shape.group_size)

        slots[min(free, key=preference)].append(expert)
        return True
    chain = _room_chain(slots, homes, capacity, expert)
    if chain is None:
        return False
    incoming = expert
    for rank, index in chain:  # each rank of the chain takes the incoming copy in place of the one it passes on
        if index is None:
            slots[rank].append(incoming)
        else:
            slots[rank][index], incoming = incoming, slots[rank][index]
    return True


def _room_chain(
    slots: list[list[int]], homes: tuple[tuple[int, ...], ...], capacity: int, expert: int
) -> list[tuple[int, int | None]] | None:
    """Breadth-first: a chain of full ranks, each passing one of its redundant copies on to the next, ending at a rank
    with a free slot. -> [(rank, slot index passed on or None at the end)], or None when there is none."""
    starts = [rank for rank, held in enumerate(slots) if expert not in held]
    came_from: dict[int, tuple[int, int] | None] = dict.fromkeys(starts)
    queue = list(starts)
    for rank in queue:
        if len(slots[rank]) < capacity:
            chain: list[tuple[int, int | None]] = [(rank, None)]
            step = came_from[rank]
            while step is not None:
                chain.append(step)
                step = came_from[step[0]]
            return chain[::-1]
        for index in range(len(homes[rank]), len(slots[rank])):
            moved = slots[rank][index]
            for target, held in enumerate(slots):
                if target not in came_from and moved not in held:
                    came_from[target] = (rank, index)
                    queue.append(target)
    return None


def _padded(held: list[int], slots_per_rank: int) -> Slots:
    return tuple(held) + (None,) * (slots_per_rank - len(held))
