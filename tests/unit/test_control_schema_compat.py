"""The control-API contract tolerates version skew in the direction that matters during upgrades."""

import pytest
from pydantic import ValidationError

from tidal.contract.control_api import SleepRequest, WeightsChecksum, WorkerState

STATE = {
    "sleep_state": "awake",
    "resident": ["weights", "kv_cache"],
    "weights_version": "base",
    "model_loaded": True,
    "rank": 0,
    "world_size": 1,
    "group_epoch": 0,
    "coordinator_rank": 0,
    "group_formed": True,
    "in_flight_requests": 0,
}


def test_operator_reads_the_state_of_a_newer_worker_that_reports_more_fields():
    state = WorkerState.model_validate({**STATE, "field_added_later": 1})
    assert state.weights_version == "base"
    checksum = WeightsChecksum.model_validate({"version": "v", "overall": "x", "tensors": {}, "new": True})
    assert checksum.overall == "x"


def test_operator_reads_the_state_of_an_older_worker_that_does_not_report_its_weights_source():
    # The planner then takes the worker at its version's word (tidal.operator.planner.weights).
    assert WorkerState.model_validate(STATE).weights_source is None
    assert WorkerState.model_validate({**STATE, "weights_source": "/m/b"}).weights_source == "/m/b"


def test_known_response_fields_are_still_validated():
    with pytest.raises(ValidationError):
        WorkerState.model_validate({**STATE, "rank": -1})


def test_requests_still_refuse_unknown_fields():
    with pytest.raises(ValidationError, match="levle"):
        SleepRequest.model_validate({"levle": 2})
