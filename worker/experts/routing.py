"""Which copy of a logical expert serves a token (pure; the dispatcher turns `routing_table` into a tensor once per
epoch and applies the same rule on the device).

Rule: a copy on the token's own rank, when there is one, since it costs no transfer and every rank routes its own
requests, so local copies split an expert's load by rank already. Otherwise the copies take turns by token index
(index modulo the number of copies), which spreads a hot expert's tokens evenly over its copies without any state.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.worker.experts.expert_map import ExpertMap, PhysicalSlot


def physical_index(copy: PhysicalSlot, slots_per_rank: int) -> int:
    """A slot's index in the group's flat list of slots: rank-major, as the dispatcher lays them out."""
    return copy.rank * slots_per_rank + copy.slot


def pick_copy(copies: Sequence[PhysicalSlot], token_index: int, source_rank: int | None = None) -> PhysicalSlot:
    """The copy (out of an expert's `copies`) that serves the token `token_index` of rank `source_rank`."""
    if not copies:
        raise ValueError("an expert has at least one copy; got none")
    if source_rank is not None:
        for copy in copies:
            if copy.rank == source_rank:
                return copy
    return copies[token_index % len(copies)]


def routing_table(expert_map: ExpertMap) -> tuple[tuple[int, ...], ...]:
    """For every logical expert, the flat physical indices of its copies (by rank): the lookup the dispatcher needs."""
    return tuple(
        tuple(physical_index(copy, expert_map.slots_per_rank) for copy in expert_map.copies(expert))
        for expert in range(expert_map.num_experts)
    )
