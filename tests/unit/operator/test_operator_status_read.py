"""The status is read leniently: it is the operator's own output, and a newer operator may have written values this
one does not know. What it cannot read is dropped (a field falls back to its default; an entry of a list, or an
object, that cannot stand without it goes), and the next status is written even where it equals what is left."""

import pytest
from operator_fixtures import make_model, pod_for, run, with_status

from tidal.operator.api.resource import InferenceModel
from tidal.operator.planner.actions import PatchStatus

CONDITION = {
    "type": "Ready",
    "status": "False",
    "reason": "RanksNotReady",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def _read(status: dict) -> InferenceModel:
    data = make_model().model_dump(mode="json", by_alias=True, exclude_none=True)
    return InferenceModel.model_validate({**data, "status": status})


@pytest.mark.parametrize(
    ("status", "kept"),
    [
        ({"phase": "Hibernating", "readyRanks": 1}, {"phase": "Pending", "readyRanks": 1}),
        ({"conditions": [CONDITION, {**CONDITION, "type": "Autoscaled"}]}, {"conditions": [CONDITION]}),
        ({"conditions": [{**CONDITION, "lastTransitionTime": "yesterday"}]}, {"conditions": []}),
        ({"ranks": [{"pod": "p", "replica": 0, "rank": 0, "state": "Migrating"}], "totalRanks": 1}, {"totalRanks": 1}),
        ({"sleepState": "Drowsy", "groups": [{"replica": 0, "state": "Splitting"}]}, {"sleepState": "None"}),
        ({"readyRanks": -1, "weightsRollout": {"message": "no version"}}, {"readyRanks": 0}),
        ("not an object", {}),
    ],
    ids=["phase", "condition-type", "condition-time", "rank-state", "sleep-and-group", "bounds-and-required", "junk"],
)
def test_what_the_status_reader_does_not_understand_is_dropped(status, kept):
    model = _read(status)
    assert model.status is not None and model.status.unread
    expected = _read(kept).status
    assert expected is not None and not expected.unread
    assert model.status.model_dump() == expected.model_dump()


def test_a_status_that_reads_whole_is_not_marked():
    status = _read({"phase": "Ready", "conditions": [CONDITION]}).status
    assert status is not None and status.unread == ()


def test_a_status_with_values_dropped_is_written_even_where_the_rest_equals_the_next_one():
    model = make_model()
    pods = [pod_for(model, 0, phase="Pending", ready=False)]
    first = run(model, pods, {})
    assert first.status.phase == "Pending"
    same = with_status(model, first)
    assert not [a for a in run(same, pods, {}).actions if isinstance(a, PatchStatus)]
    data = same.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["status"]["phase"] = "Hibernating"  # reads back as the default, Pending: what this pass computes
    unknown = InferenceModel.model_validate(data)
    assert [a for a in run(unknown, pods, {}).actions if isinstance(a, PatchStatus)]
