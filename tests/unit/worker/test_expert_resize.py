"""Resizing an expert-parallel group by epochs (pure): the slots per rank stay, the group size changes; ranks that
stay keep their first copies in the same slots, and a size whose ranks have too few slots is refused."""

from __future__ import annotations

import pytest

from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, NotEnoughSlotsError
from tidal.worker.experts.full_layout import full_layout, home_experts
from tidal.worker.experts.placement import plan_placement


def _held(expert_map: ExpertMap, rank: int) -> set[int]:
    return {e for e in expert_map.rank_slots(rank) if e is not None}


def _first_copies_stay(before: ExpertMap, after: ExpertMap, rank: int) -> bool:
    """Whether `rank`'s first copies in the larger of the two groups are its first slots in both maps (growing, a
    rank hands the newcomer a tail of its first copies; shrinking, it inherits some: the rest stays in place)."""
    larger = max(before.group_size, after.group_size)
    homes = home_experts(before.num_experts, larger)[rank]
    return before.rank_slots(rank)[: len(homes)] == homes == after.rank_slots(rank)[: len(homes)]


def test_grow_three_to_four_and_back_keeps_the_slot_count_and_the_first_copies():
    three = GroupShape.even_share(8, 3, 1)
    assert three.slots_per_rank == 4  # ceil(8 / 3) + 1, fixed for the workers' lives
    four = three.resized(4)
    assert (four.group_size, four.slots_per_rank) == (4, 4)
    start = full_layout(three)

    grown = plan_placement(four, [0, 1, 2, 3], previous=start)
    assert grown.expert_map == full_layout(four)  # what rank 3, started for a group of 4 with S = 4, holds already
    assert grown.expert_map.to_json()["group_size"] == 4 and grown.expert_map.to_json()["slots_per_rank"] == 4
    assert grown.missing_experts == ()
    for rank in (0, 1, 2):
        assert _first_copies_stay(start, grown.expert_map, rank)
        homes = home_experts(8, 4)[rank]
        assert len(grown.changes_of(rank).loads) <= four.slots_per_rank - len(homes)  # redundant slots at most
    assert sorted(grown.changes_of(3).loaded_experts) == sorted(_held(grown.expert_map, 3))  # new: loads it all

    shrunk = plan_placement(three, [0, 1, 2], previous=grown.expert_map)
    assert shrunk.expert_map == start  # back to the layout the group of three started with
    for rank in (0, 1, 2):
        assert _first_copies_stay(grown.expert_map, start, rank)
        assert set(home_experts(8, 3)[rank]) <= _held(start, rank)  # and it holds what it inherits from rank 3


@pytest.mark.parametrize("num_experts", [4, 8, 9, 16, 60])
def test_with_a_fixed_slot_count_every_size_with_room_has_a_layout_nested_in_its_neighbours(num_experts: int):
    for slots_per_rank in range(1, num_experts + 1):
        sizes = [n for n in range(1, 9) if n * slots_per_rank >= num_experts]
        for size in sizes:
            shape = GroupShape(num_experts, size, slots_per_rank)
            layout = full_layout(shape)
            assert all(len(layout.copies(e)) >= 1 for e in range(num_experts))
            if size + 1 in sizes:
                grown = plan_placement(shape.resized(size + 1), range(size + 1), previous=layout)
                assert all(_first_copies_stay(layout, grown.expert_map, rank) for rank in range(size))
            if size - 1 in sizes:
                shrunk = plan_placement(shape.resized(size - 1), range(size - 1), previous=layout)
                assert all(_first_copies_stay(layout, shrunk.expert_map, rank) for rank in range(size - 1))


def test_a_size_whose_ranks_have_too_few_slots_is_refused_with_the_number_missing():
    four = GroupShape.even_share(8, 4, 0)  # two slots a rank
    with pytest.raises(NotEnoughSlotsError, match=r"3 x 2 = 6 expert slots for 8 experts: 2 slots missing") as err:
        plan_placement(four.resized(3), [0, 1, 2], previous=full_layout(four))
    assert err.value.missing_slots == 2
    with pytest.raises(NotEnoughSlotsError, match="1 slot missing"):
        full_layout(GroupShape(9, 4, 2))


def test_a_degraded_epoch_of_a_grown_group_repairs_from_the_smaller_map():
    three = GroupShape.even_share(8, 3, 0)  # 3 slots a rank, no spare copy
    start = full_layout(three)
    plan = plan_placement(three.resized(4), [0, 2, 3], previous=start)  # grown by rank 3 while rank 1 is down
    assert plan.expert_map.group_size == 4 and plan.expert_map.present_ranks == (0, 2, 3)
    assert set(plan.missing_experts) == _held(start, 1)  # rank 1's experts had no other copy
    assert plan.expert_map.rank_slots(3) == full_layout(three.resized(4)).rank_slots(3)  # the newcomer's share
    for rank in (0, 2):  # the survivors read only what has no copy left
        assert set(plan.changes_of(rank).loaded_experts) <= set(plan.missing_experts)


def test_a_shape_needs_at_least_one_slot_and_keeps_its_slots_when_resized():
    with pytest.raises(ExpertMapError, match="slots_per_rank must be at least 1"):
        GroupShape(8, 4, 0)
    with pytest.raises(ExpertMapError, match="group_size must be at least 1"):
        GroupShape.even_share(8, 4, 1).resized(0)
    assert GroupShape.even_share(8, 4, 1) == GroupShape(8, 4, 3)
