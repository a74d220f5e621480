"""The expert location map (pure): its JSON form, the checks on a map received from outside, a rank's changes between
two maps, and the choice of copy for a token."""

from __future__ import annotations

import json

import pytest

from tidal.worker.experts.changes import SlotLoad, SlotMove, rank_changes
from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, PhysicalSlot
from tidal.worker.experts.full_layout import full_layout
from tidal.worker.experts.placement import plan_placement
from tidal.worker.experts.routing import physical_index, pick_copy, routing_table

GOOD = {"num_experts": 4, "group_size": 3, "slots_per_rank": 2, "slots": [[0, 1], None, [2, 3]]}


def test_a_map_travels_as_json_and_comes_back_equal():
    for expert_map in (
        full_layout(GroupShape.even_share(8, 4, 1)),
        plan_placement(GroupShape.even_share(8, 4, 2), [1, 3]).expert_map,
    ):
        wire = json.loads(json.dumps(expert_map.to_json()))
        assert ExpertMap.from_json(wire) == expert_map
    assert ExpertMap.from_json(GOOD).to_json() == GOOD
    assert ExpertMap.from_json(GOOD).present_ranks == (0, 2)


def _with(**changes: object) -> dict[str, object]:
    return {**GOOD, **changes}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([1, 2], "an expert map is a JSON object, got list"),
        ({"num_experts": 4}, "missing fields ['group_size', 'slots', 'slots_per_rank']"),
        (_with(epoch=3), "unknown fields ['epoch']"),
        (_with(num_experts="4"), "num_experts must be an integer, got '4'"),
        (_with(group_size=True), "group_size must be an integer, got True"),
        (_with(slots={"0": [0, 1]}), "slots must be a list with one entry per rank, got dict"),
        (_with(slots=[[0, 1], None, [2, "3"]]), "slots[2] must be null or a list of expert ids and nulls"),
        (_with(slots_per_rank=0), "must be at least 1, got 4, 3, 0"),
        (_with(slots=[[0, 1], [2, 3]]), "slots has 2 entries, one per rank of the group of 3 is needed"),
        (_with(slots=[None, None, None]), "no rank is present"),
        (_with(slots=[[0, 1, 2], None, [2, 3]]), "rank 0 has 3 slots, not 2"),
        (_with(slots=[[0, 4], None, [2, 3]]), "rank 0 holds experts [4], outside 0..3"),
        (_with(slots=[[0, -1], None, [2, 3]]), "rank 0 holds experts [-1], outside 0..3"),
        (_with(slots=[[0, 0], [1, None], [2, 3]]), "rank 0 holds experts [0] more than once"),
        (_with(slots=[[0, None], None, [2, 3]]), "experts [1] have no copy on any present rank"),
    ],
)
def test_a_bad_map_from_outside_is_refused_with_the_reason(data: object, problem: str):
    with pytest.raises(ExpertMapError) as refused:
        ExpertMap.from_json(data)
    assert any(problem in p for p in refused.value.problems), refused.value.problems


def test_every_problem_is_listed_at_once():
    with pytest.raises(ExpertMapError) as refused:
        ExpertMap.from_json(_with(slots=[[0, 0, 1], None, [5, None]]))
    assert len(refused.value.problems) >= 4  # slot count, repeat, out of range, uncovered


def test_a_received_map_must_fit_the_group_and_the_epochs_members():
    expert_map = ExpertMap.from_json(GOOD)
    expert_map.check_fits(GroupShape.even_share(4, 3, 0), [2, 0])
    with pytest.raises(ExpertMapError) as refused:
        expert_map.check_fits(GroupShape.even_share(4, 3, 1), [0, 1, 2])
    assert refused.value.problems == [
        "the map has slots_per_rank 2, this group has 3",
        "the map's ranks [0, 2] are not the epoch's members [0, 1, 2]",
    ]


def test_copies_and_rank_slots():
    expert_map = ExpertMap.from_json(_with(slots=[[0, 1], [1, None], [2, 3]]))
    assert expert_map.copies(1) == (PhysicalSlot(0, 1), PhysicalSlot(1, 0))
    assert expert_map.rank_slots(1) == (1, None)
    with pytest.raises(KeyError, match="rank 5 is not in this map"):
        expert_map.rank_slots(5)


def test_changes_name_loads_moves_and_drops_per_rank():
    before = ExpertMap(4, 2, 3, ((0, 1, 2), (3, 2, None)))
    after = ExpertMap(4, 2, 3, ((1, 0, 3), (3, 2, 0)))
    first, second = rank_changes(before, after)
    assert first.loads == (SlotLoad(slot=2, expert=3),)
    assert first.moves == (SlotMove(expert=1, from_slot=1, to_slot=0), SlotMove(expert=0, from_slot=0, to_slot=1))
    assert first.drops == (2,)
    assert (second.loads, second.moves, second.drops) == ((SlotLoad(2, 0),), (), ())
    fresh = rank_changes(None, after)  # no previous map: everything is loaded
    assert [change.loaded_experts for change in fresh] == [(1, 0, 3), (3, 2, 0)]
    with pytest.raises(ExpertMapError, match="no common ids"):
        rank_changes(ExpertMap(2, 1, 2, ((0, 1),)), after)


def test_a_token_uses_a_local_copy_else_the_copies_take_turns():
    copies = (PhysicalSlot(0, 2), PhysicalSlot(2, 0), PhysicalSlot(3, 1))
    assert pick_copy(copies, token_index=7, source_rank=2) == PhysicalSlot(2, 0)
    assert [pick_copy(copies, i, source_rank=1) for i in range(4)] == [*copies, copies[0]]
    assert pick_copy(copies, 5) == copies[2]
    with pytest.raises(ValueError, match="at least one copy"):
        pick_copy((), 0)


def test_the_routing_table_lists_each_experts_flat_slot_indices():
    expert_map = ExpertMap.from_json(_with(slots=[[0, 1], [1, None], [2, 3]]))
    assert physical_index(PhysicalSlot(2, 1), slots_per_rank=2) == 5
    assert routing_table(expert_map) == ((0,), (1, 2), (4,), (5,))
