"""The expert-placement planner (pure): the full layout, a lost rank, too few slots, rejoin, resize, load-aware
redundancy and determinism, plus property loops over many small groups."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, NotEnoughSlotsError
from tidal.worker.experts.full_layout import full_layout, home_experts
from tidal.worker.experts.placement import plan_placement


def _held(expert_map: ExpertMap, rank: int) -> set[int]:
    return {e for e in expert_map.rank_slots(rank) if e is not None}


def _holders(expert_map: ExpertMap, expert: int) -> set[int]:
    return {copy.rank for copy in expert_map.copies(expert)}


def test_the_full_layout_of_eight_experts_on_four_ranks_with_one_redundant_slot():
    shape = GroupShape.even_share(num_experts=8, group_size=4, redundant_slots_per_rank=1)
    assert shape.slots_per_rank == 3
    layout = full_layout(shape)
    # first copies two per rank (nested homes), then one backup each of every rank's first home expert, placed on
    # the home's successor
    assert layout.slots == ((0, 1, 2), (4, 5, 0), (3, 7, 4), (2, 6, 3))
    assert [_holders(layout, e) for e in range(8)] == [{0, 1}, {0}, {0, 3}, {2, 3}, {1, 2}, {1}, {3}, {2}]
    assert plan_placement(shape, [3, 1, 0, 2]).expert_map == layout  # a fresh start is the full layout


def test_first_copies_are_balanced_and_nested_across_group_sizes():
    for num_experts in range(1, 40):
        previous: tuple[tuple[int, ...], ...] = ()
        for group_size in range(1, 12):
            homes = home_experts(num_experts, group_size)
            assert sorted(e for held in homes for e in held) == list(range(num_experts))
            share = num_experts // group_size
            assert all(share <= len(held) <= share + 1 for held in homes)
            for rank, held in enumerate(previous):  # growing by one: the ranks there keep a prefix of their homes
                assert held[: len(homes[rank])] == homes[rank]
            previous = homes


def test_a_lost_rank_costs_nothing_when_every_expert_has_a_backup():
    shape = GroupShape.even_share(8, 4, 2)  # 16 slots: every expert has two copies, on different ranks
    layout = full_layout(shape)
    assert all(len(layout.copies(e)) == 2 for e in range(8))
    for lost in range(4):
        survivors = [r for r in range(4) if r != lost]
        plan = plan_placement(shape, survivors, previous=layout)
        assert plan.missing_experts == ()
        assert all(change.is_unchanged for change in plan.changes)
        assert plan.expert_map.slots == tuple(None if r == lost else layout.slots[r] for r in range(4))


def test_when_both_holders_of_an_expert_die_the_plan_says_which_survivors_load_it():
    shape = GroupShape.even_share(8, 4, 2)
    layout = full_layout(shape)
    lost = {2, 3}
    gone = [e for e in range(8) if _holders(layout, e) <= lost]
    assert gone, "the layout should have experts held only by ranks 2 and 3"
    plan = plan_placement(shape, [0, 1], previous=layout)
    assert plan.missing_experts == tuple(gone)
    loaded = sorted(e for change in plan.changes for e in change.loaded_experts)
    assert loaded == gone  # each missing expert is read once, nothing else is read
    for change in plan.changes:  # what a survivor gave up still has a copy
        assert all(_holders(plan.expert_map, e) for e in change.drops)
        assert _held(plan.expert_map, change.rank) >= _held(layout, change.rank) - set(change.drops)
    per_rank = [len(change.loads) for change in plan.changes]
    assert max(per_rank) - min(per_rank) <= 1  # the reloads are spread over the survivors


def test_too_few_slots_is_refused_with_the_number_missing():
    shape = GroupShape.even_share(8, 4, 0)  # two slots a rank
    with pytest.raises(
        NotEnoughSlotsError,
        match=r"ranks \[0, 2, 3\] have 3 x 2 = 6 expert slots for 8 experts: "
        r"2 slots missing",
    ) as refused:
        plan_placement(shape, [0, 2, 3], previous=full_layout(shape))
    assert refused.value.missing_slots == 2
    assert plan_placement(GroupShape.even_share(8, 4, 1), [0, 2, 3]).expert_map.present_ranks == (0, 2, 3)


def test_a_rejoin_returns_the_full_layout_and_the_replacement_loads_its_share():
    shape = GroupShape.even_share(8, 4, 1)
    layout = full_layout(shape)
    degraded = plan_placement(shape, [0, 2, 3], previous=layout)
    assert degraded.missing_experts == (5,)  # rank 1 held the only copy of 5
    rejoined = plan_placement(shape, [0, 1, 2, 3], previous=degraded.expert_map)
    assert rejoined.expert_map == layout
    replacement = rejoined.changes_of(1)
    assert replacement.loads and sorted(replacement.loaded_experts) == sorted(_held(layout, 1))
    assert not replacement.drops
    # the survivor that took 5 gives it back and reloads what it gave up; the others do nothing
    assert [change.rank for change in rejoined.changes if not change.is_unchanged] == [1, 3]


def test_growing_a_group_by_one_moves_no_first_copy_and_no_more_than_the_new_rank_loads():
    for num_experts in (4, 8, 16, 60):
        for group_size in range(1, 7):
            for redundant in range(3):
                before = full_layout(GroupShape.even_share(num_experts, group_size, redundant))
                grown = GroupShape.even_share(num_experts, group_size + 1, redundant)
                plan = plan_placement(grown, range(group_size + 1), previous=before)
                assert plan.expert_map == full_layout(grown)
                homes = home_experts(num_experts, group_size + 1)
                newcomer = plan.changes_of(group_size)
                for change in plan.changes[:-1]:
                    assert set(homes[change.rank]) <= _held(before, change.rank)  # its first copies stay put
                    assert len(change.loads) <= grown.slots_per_rank - len(homes[change.rank])
                    assert len(change.loads) <= len(newcomer.loads)


def test_shrinking_a_group_by_one_loads_only_inherited_first_copies_and_redundant_slots():
    for num_experts in (4, 8, 16, 60):
        for group_size in range(2, 8):
            for redundant in range(3):
                before = full_layout(GroupShape.even_share(num_experts, group_size, redundant))
                shrunk = GroupShape.even_share(num_experts, group_size - 1, redundant)
                plan = plan_placement(shrunk, range(group_size - 1), previous=before)
                old_homes = home_experts(num_experts, group_size)
                new_homes = home_experts(num_experts, group_size - 1)
                for change in plan.changes:
                    assert set(old_homes[change.rank]) <= set(new_homes[change.rank])
                    inherited = set(new_homes[change.rank]) - set(old_homes[change.rank])
                    assert set(change.loaded_experts) - inherited <= set(plan.expert_map.rank_slots(change.rank))
                    redundant_slots = shrunk.slots_per_rank - len(new_homes[change.rank])
                    assert len(set(change.loaded_experts) - inherited) <= redundant_slots


def test_redundant_slots_go_to_the_most_loaded_experts_by_load_per_copy():
    shape = GroupShape.even_share(8, 4, 1)  # 4 spare slots
    load = [1.0, 1.0, 1.0, 1.0, 1.0, 100.0, 40.0, 1.0]
    layout = full_layout(shape, load)
    # load per copy, copy by copy: 5 (100) -> 5 (50 > 40) -> 6 (40 > 33.3) -> 5 (33.3 > 25 and 20)
    assert [len(layout.copies(e)) for e in range(8)] == [1, 1, 1, 1, 1, 4, 2, 1]
    assert _holders(layout, 5) == {0, 1, 2, 3}
    assert full_layout(shape, [0.0] * 8) == full_layout(shape)  # no traffic: the layout without load
    even = full_layout(shape, [3.0] * 8)  # equal traffic: the same experts get copies (placed by rank load)
    assert [len(even.copies(e)) for e in range(8)] == [len(full_layout(shape).copies(e)) for e in range(8)]


def _peak_rank_load(expert_map: ExpertMap, load: list[float]) -> float:
    """The busiest rank's share of the load, each copy of an expert taking an equal part of its load."""
    return max(
        sum(load[e] / len(expert_map.copies(e)) for e in slots if e is not None)
        for slots in expert_map.slots
        if slots is not None
    )


def test_load_aware_layouts_relieve_the_busiest_rank_under_skewed_load():
    rng = random.Random(13)
    aware = blind = 0.0
    for _ in range(50):
        shape = GroupShape.even_share(rng.choice([8, 16, 32, 64]), rng.choice([2, 4, 8]), rng.choice([1, 2]))
        load = [rng.paretovariate(1.2) for _ in range(shape.num_experts)]  # a few hot experts, a long tail
        aware += _peak_rank_load(full_layout(shape, load), load)
        blind += _peak_rank_load(full_layout(shape), load)
    assert aware < 0.8 * blind


def test_plans_are_deterministic():
    shape = GroupShape.even_share(16, 5, 2)
    load = [float((7 * e) % 5) for e in range(16)]
    first = plan_placement(shape, [0, 1, 3], previous=full_layout(shape, load), load=load)
    again = plan_placement(shape, [3, 1, 0], previous=full_layout(shape, load), load=list(load))
    assert first == again


@pytest.mark.parametrize(
    ("present", "match"),
    [([], "no rank is present"), ([0, 0, 1], "repeat a rank"), ([0, 4], r"ranks \[4\] are outside the group of 4")],
)
def test_bad_member_lists_are_refused(present: list[int], match: str):
    with pytest.raises(ExpertMapError, match=match):
        plan_placement(GroupShape.even_share(8, 4, 1), present)


def test_bad_shapes_loads_and_previous_maps_are_refused():
    with pytest.raises(ExpertMapError, match="num_experts must be at least 1"):
        GroupShape.even_share(0, 4, 1)
    with pytest.raises(ExpertMapError, match="redundant_slots_per_rank must be at least 0"):
        GroupShape.even_share(8, 4, -1)
    with pytest.raises(ExpertMapError, match="load has 3 values, one per expert"):
        plan_placement(GroupShape.even_share(8, 4, 1), [0, 1, 2], load=[1.0, 2.0, 3.0])
    with pytest.raises(ExpertMapError, match=r"load of experts \[1\] is not a finite number"):
        plan_placement(GroupShape.even_share(2, 2, 1), [0, 1], load=[1.0, float("nan")])
    with pytest.raises(ExpertMapError, match="the previous map has 8 experts, this group has 6"):
        plan_placement(GroupShape.even_share(6, 4, 1), [0, 1, 2], previous=full_layout(GroupShape.even_share(8, 4, 1)))


def _check_degraded(shape: GroupShape, previous: ExpertMap, present: list[int]) -> ExpertMap | None:
    """Plan `present` after `previous` and check every rule; -> the new map, None when (rightly) refused."""
    if len(present) * shape.slots_per_rank < shape.num_experts:
        with pytest.raises(NotEnoughSlotsError):
            plan_placement(shape, present, previous=previous)
        return None
    plan = plan_placement(shape, present, previous=previous)
    new = plan.expert_map
    assert new.present_ranks == tuple(present)
    assert all(new.copies(e) for e in range(shape.num_experts))  # ExpertMap checks this too
    before = {e for r in present if previous.slots[r] is not None for e in _held(previous, r)}
    assert plan.missing_experts == tuple(e for e in range(shape.num_experts) if e not in before)
    for change in plan.changes:
        if previous.slots[change.rank] is None:
            continue  # a newcomer loads its full-layout share
        # a survivor loads only missing experts, keeps its slots, and gives up only copies held elsewhere
        assert set(change.loaded_experts) <= set(plan.missing_experts)
        assert not change.moves
        assert len(change.drops) <= len(change.loads)
        assert all(_holders(new, e) for e in change.drops)
    loaded = sorted(e for c in plan.changes if previous.slots[c.rank] is not None for e in c.loaded_experts)
    newcomers = {e for c in plan.changes if previous.slots[c.rank] is None for e in c.loaded_experts}
    assert loaded == sorted(set(plan.missing_experts) - newcomers)  # each missing expert read once
    return new


def test_every_small_group_survives_every_failure_and_a_second_one_after_it():
    checked = 0
    for num_experts in range(1, 11):
        for group_size in range(1, 5):
            for redundant in range(3):
                shape = GroupShape.even_share(num_experts, group_size, redundant)
                layout = full_layout(shape)
                for size in range(1, group_size):
                    for present in combinations(range(group_size), size):
                        degraded = _check_degraded(shape, layout, list(present))
                        checked += 1
                        if degraded is None:
                            continue
                        for second in combinations(present, size - 1) if size > 1 else ():
                            _check_degraded(shape, degraded, list(second))
                        again = plan_placement(shape, range(group_size), previous=degraded)
                        assert again.expert_map == layout
    assert checked > 500


def test_a_newcomer_in_a_degraded_epoch_gets_its_full_layout_share():
    shape = GroupShape.even_share(8, 4, 1)
    layout = full_layout(shape)
    without_1 = plan_placement(shape, [0, 2, 3], previous=layout).expert_map
    # rank 1 comes back while rank 2 is lost: rank 1 gets its share, survivors repair only what is still missing
    plan = plan_placement(shape, [0, 1, 3], previous=without_1)
    assert plan.expert_map.rank_slots(1) == layout.rank_slots(1)
    assert all(plan.expert_map.copies(e) for e in range(8))
