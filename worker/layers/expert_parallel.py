"""Expert parallelism's shared state: what this rank's expert slots hold, and the epoch it serves them in.

A model built for a group of more than one rank gives each MoE layer S expert slots instead of E experts (S =
ceil(E / world_size) + R, or the count the settings give); every layer's slot s holds the same logical expert (one
map serves all MoE layers), so one `ExpertParallelState` per model says what the slots hold. S is fixed for the
model's life (the stacks are allocated once); the group size is the current epoch's, so the group can be resized by
epochs around the ranks that stay. The state also keeps the current epoch: its `ExpertComm` (the process group of
the epoch's members) and the routing tensors built from the epoch's map once, when the epoch is installed, so that
a step picks every token's copy on the device without a Python loop.

Routing (the rule of tidal.worker.experts.routing): a copy on this rank when there is one, else the copies take turns
by the token's row index in the step. Both cases are one table: row e lists the copies rank `me` may use for logical
expert e (just its own copy, or every copy), as flat destinations group_index * S + slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tidal.worker.experts.changes import RankChanges, rank_changes
from tidal.worker.experts.expert_map import ExpertMap, GroupShape, Slots
from tidal.worker.experts.placement import plan_placement
from tidal.worker.layers.expert_exchange import ExchangeStats


@dataclass(frozen=True)
class ExpertParallelSettings:
    """Where this process sits in its expert-parallel group (from EngineConfig): global rank, the group size it starts
    for, and its expert slots: the redundant ones beyond an even share, or a count given outright (a rank joining a
    running group takes its members' count, which a resize since their start no longer derives)."""

    rank: int
    world_size: int
    redundant_slots_per_rank: int = 0
    slots_per_rank: int | None = None  # None: ceil(E / world_size) + redundant_slots_per_rank
    time_exchanges: bool = False  # time each dispatch and combine (expert_exchange.py: a measuring setting)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")
        if self.redundant_slots_per_rank < 0:
            raise ValueError(f"redundant_slots_per_rank must be at least 0, got {self.redundant_slots_per_rank}")
        if self.slots_per_rank is not None and self.slots_per_rank < 1:
            raise ValueError(f"expert slots per rank must be at least 1, got {self.slots_per_rank}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def start_shape(self, num_experts: int) -> GroupShape:
        """The shape of the group this process starts in."""
        if self.slots_per_rank is None:
            return GroupShape.even_share(num_experts, self.world_size, self.redundant_slots_per_rank)
        return GroupShape(num_experts, self.world_size, self.slots_per_rank)


class ExpertComm(Protocol):
    """The collectives an epoch's MoE layers need (tidal.worker.group's EpochGroup is one). Tensors are on the
    group's device; `members` are the epoch's global ranks, sorted, and a rank's group index is its position there."""

    @property
    def size(self) -> int: ...

    @property
    def group_rank(self) -> int: ...

    @property
    def members(self) -> Sequence[int]: ...

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [size] int64 (rows for each member) -> [size] int64 (rows from each member)."""
        ...

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """send [sum(send_counts), ...] (rows for each member, in member order) -> [sum(recv_counts), ...]."""
        ...


class ExpertGroupMissingError(RuntimeError):
    """A MoE layer ran while no epoch was installed (before the first one, or after the group broke)."""


@dataclass(frozen=True)
class EpochRouting:
    """An epoch's routing tensors on the device: for logical expert e, copies rank `me` may send a token to."""

    copy_table: torch.Tensor  # [E, C] int64: flat destinations group_index * S + slot, padded with the first copy
    num_copies: torch.Tensor  # [E] int64: how many entries of the row are real (1 where this rank has a copy)
    slots_per_rank: int


def build_routing(expert_map: ExpertMap, members: Sequence[int], my_rank: int, device: torch.device) -> EpochRouting:
    """The routing tensors of `expert_map` for rank `my_rank`, destinations as group indices of `members`."""
    group_index = {rank: i for i, rank in enumerate(members)}
    num_slots = expert_map.slots_per_rank
    rows = []
    for expert in range(expert_map.num_experts):
        copies = expert_map.copies(expert)
        usable = [c for c in copies if c.rank == my_rank] or list(copies)
        rows.append([group_index[c.rank] * num_slots + c.slot for c in usable])
    width = max(len(row) for row in rows)
    table = [row + [row[0]] * (width - len(row)) for row in rows]
    return EpochRouting(
        copy_table=torch.tensor(table, dtype=torch.int64, device=device),
        num_copies=torch.tensor([len(row) for row in rows], dtype=torch.int64, device=device),
        slots_per_rank=num_slots,
    )


class LoopbackComm:
    """A group of this rank alone: every exchange gives back what it was given (`warm_up_alone`'s stand-in)."""

    def __init__(self, rank: int) -> None:
        self.members = (rank,)
        self.group_rank = 0
        self.size = 1

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        return send


class ExpertParallelState:
    """One per model: the current expert map (this rank's slots are its row), the epoch's comm and routing."""

    def __init__(self, settings: ExpertParallelSettings, num_experts: int) -> None:
        self.settings = settings
        self.shape = settings.start_shape(num_experts)  # the start group's; an epoch's is `shape_for(its size)`
        if self.shape.slots_per_rank > num_experts:
            raise ValueError(
                f"{self.shape.slots_per_rank} expert slots per rank for {num_experts} experts: a rank never holds two "
                f"copies of one expert, so lower redundant_experts_per_rank ({settings.redundant_slots_per_rank}) "
                f"or expert_slots_per_rank"
            )
        # At start every rank holds its slots of the full layout; the first epoch normally keeps them. A slot count
        # too small for the start group (N x S < E) is refused here (NotEnoughSlotsError, a ValueError).
        self.expert_map = plan_placement(self.shape, range(settings.world_size)).expert_map
        self.comm: ExpertComm | None = None
        self.routing: EpochRouting | None = None
        self.exchange = ExchangeStats(settings.time_exchanges)  # over every epoch: the counters only grow

    @property
    def rank(self) -> int:
        return self.settings.rank

    @property
    def slots_per_rank(self) -> int:
        return self.shape.slots_per_rank

    def shape_for(self, group_size: int) -> GroupShape:
        """This model's experts and slots over an epoch's `group_size` ranks."""
        return self.shape.resized(group_size)

    @property
    def slots(self) -> Slots:
        """The logical expert each of this rank's slots holds (None: empty)."""
        return self.expert_map.rank_slots(self.rank)

    @property
    def held_experts(self) -> frozenset[int]:
        return frozenset(e for e in self.slots if e is not None)

    def changes_to(self, expert_map: ExpertMap) -> RankChanges:
        """What this rank loads, moves and drops to go from its slots now to its slots in `expert_map`."""
        return next(c for c in rank_changes(self.expert_map, expert_map) if c.rank == self.rank)

    def epoch(self) -> tuple[ExpertComm, EpochRouting]:
        if self.comm is None or self.routing is None:
            raise ExpertGroupMissingError(
                f"rank {self.rank} has no expert-parallel epoch installed: its MoE layers cannot reach their experts"
            )
        return self.comm, self.routing

    def enter_epoch(self, expert_map: ExpertMap, comm: ExpertComm, routing: EpochRouting) -> None:
        """Serve `expert_map` through `comm` (the slots already hold what the map says)."""
        self.expert_map, self.comm, self.routing = expert_map, comm, routing

    @contextlib.contextmanager
    def warm_up_alone(self, device: torch.device) -> Iterator[None]:
        """Inside, the MoE layers run with this rank alone, every expert sent to one of its own slots (e mod S):
        wrong answers, but every kernel and code path of a real step. Only before the first epoch."""
        if self.comm is not None:
            raise RuntimeError("a warm-up runs before the first epoch only")
        num_experts, slots = self.shape.num_experts, self.slots_per_rank
        table = torch.arange(num_experts, dtype=torch.int64, device=device).remainder(slots).view(-1, 1)
        ones = torch.ones(num_experts, dtype=torch.int64, device=device)
        self.comm, self.routing = LoopbackComm(self.rank), EpochRouting(table, ones, slots)
        try:
            yield
        finally:
            self.comm, self.routing = None, None

    def drop_comm(self) -> None:
        """Forget the epoch's group (it broke); the slots and the map stay as they are for the next epoch."""
        self.comm, self.routing = None, None
