from datetime import UTC, datetime, timedelta

from tidal.operator.api.conditions import find_condition, flipped, set_condition

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_transition_time_moves_only_when_status_flips():
    conds = set_condition([], "Ready", "False", "RanksNotReady", "0/1", T0, 1)
    later = set_condition(conds, "Ready", "False", "RanksNotReady", "still 0/1", T0 + timedelta(minutes=1), 2)
    cond = find_condition(later, "Ready")
    assert cond is not None and cond.last_transition_time == T0
    assert cond.message == "still 0/1" and cond.observed_generation == 2
    flip = set_condition(later, "Ready", "True", "AllRanksReady", "1/1", T0 + timedelta(minutes=2), 2)
    flipped_cond = find_condition(flip, "Ready")
    assert flipped_cond is not None and flipped_cond.last_transition_time == T0 + timedelta(minutes=2)


def test_set_condition_keeps_others_and_order():
    conds = set_condition([], "Ready", "False", "A", "", T0, 1)
    conds = set_condition(conds, "Degraded", "False", "AsExpected", "", T0, 1)
    conds = set_condition(conds, "Ready", "True", "B", "", T0, 1)
    assert [c.type for c in conds] == ["Ready", "Degraded"]


def test_flipped_reports_new_and_changed_only():
    before = set_condition([], "Ready", "False", "A", "", T0, 1)
    after = set_condition(before, "Ready", "False", "A2", "other message", T0, 1)
    assert flipped(before, after) == []
    after = set_condition(after, "Degraded", "True", "CrashLoop", "", T0, 1)
    assert [c.type for c in flipped(before, after)] == ["Degraded"]
