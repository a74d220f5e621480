"""Planner: the status does not flap. A rank whose `/state` went unanswered a few times in a row keeps its last
answer in the status; a rank that serves nothing yet and will load the desired weights (scale-up, a replaced or
restarted pod) does not turn WeightsSynced False; Ready and the phase follow the pods, as capacity does."""

from operator_fixtures import healthy, make_model, pod_for, pod_name, run, with_status, worker

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import EmitEvent, PatchStatus
from tidal.operator.planner.facts import HOLD_MISSED_READS
from tidal.operator.planner.observed import RankObservation


def _cond(result, type_):
    cond = find_condition(result.status.conditions, type_)
    assert cond is not None
    return cond


def _events(result) -> list[str]:
    return [a.reason for a in result.actions if isinstance(a, EmitEvent)]


def _missed(answer: RankObservation, reads: int) -> RankObservation:
    """`answer`'s rank, now silent for `reads` `/state` calls in a row (the fleet passes its last answer on)."""
    return RankObservation(
        silent_for_s=1.0 * reads, missed_reads=reads, last_state=answer.state, last_checksum=answer.checksum
    )


def _synced(replicas: int = 2):
    model = make_model({"replicas": replicas})
    pods, ranks = healthy(model)
    first = run(model, pods, ranks)
    assert _cond(first, "WeightsSynced").status == "True" and first.status.phase == "Ready"
    return with_status(model, first), pods, ranks


def test_a_missed_state_read_changes_nothing_in_the_status_until_the_misses_reach_the_hold():
    model, pods, ranks = _synced()
    name = pod_name(model, 1)
    for reads in range(1, HOLD_MISSED_READS):
        blip = run(model, pods, {**ranks, name: _missed(ranks[name], reads)}, minutes=reads)
        assert not [a for a in blip.actions if isinstance(a, PatchStatus)], f"status rewritten after {reads} miss(es)"
        assert _events(blip) == []
    # Silent for the whole hold: what it last said is no longer taken for what it does.
    gone = run(model, pods, {**ranks, name: _missed(ranks[name], HOLD_MISSED_READS)}, minutes=5)
    assert _cond(gone, "WeightsSynced").status == "False" and gone.status.phase == "Loading"
    assert gone.status.ranks[1].weights_version is None


def test_a_silent_rank_whose_pod_is_not_ready_holds_nothing():
    # The kubelet says the container is down (or failing its probe): its last answer is not what it does now.
    model, pods, ranks = _synced()
    name = pod_name(model, 1)
    pods[1] = pod_for(model, 1, ready=False)
    result = run(model, pods, {**ranks, name: _missed(ranks[name], 1)}, minutes=1)
    assert result.status.ranks[1].state == "Loading" and result.status.phase == "Loading"
    assert _cond(result, "Ready").status == "False"


def test_a_scale_up_keeps_weights_synced_while_ready_and_phase_tell_the_missing_capacity():
    model, pods, ranks = _synced()
    bigger = with_status(make_model({"replicas": 3}, generation=2), run(model, pods, ranks))
    pending = [*pods, pod_for(bigger, 2, phase="Pending", ready=False)]
    step = run(bigger, pending, ranks, minutes=1)
    assert _cond(step, "WeightsSynced").status == "True"
    assert step.status.phase == "Pending" and _cond(step, "Ready").status == "False"
    loading = [*pods, pod_for(bigger, 2, ready=False)]
    step = run(
        with_status(bigger, step), loading, {**ranks, pod_name(bigger, 2): worker(model_loaded=False)}, minutes=2
    )
    assert _cond(step, "WeightsSynced").status == "True" and step.status.phase == "Loading"
    assert "WaitingForRanks" not in _events(step)


def test_a_restarted_pod_that_reloads_the_desired_weights_keeps_weights_synced():
    model, pods, ranks = _synced()
    name = pod_name(model, 0)
    pods[0] = pod_for(model, 0, ready=False, restart_count=1)
    step = run(model, pods, {**ranks, name: worker(model_loaded=False, weights_version=None)}, minutes=1)
    assert _cond(step, "WeightsSynced").status == "True" and _events(step) == ["RanksNotReady"]


def test_a_rank_that_will_come_back_on_other_weights_is_not_synced():
    # Its pod starts on base, and the spec (and the ranks that serve) moved to v2 in place: once loaded it serves base.
    base = make_model({"replicas": 2})
    v2 = make_model({"replicas": 2, "weights": {"version": "v2", "source": "ckpt/v2"}}, generation=2)
    pods, _ = healthy(base)
    ranks = {p.name: worker("v2", "sum-v2", weights_source="/srv/models/ckpt/v2") for p in pods}
    synced = with_status(v2, run(v2, pods, ranks))
    assert _cond(run(synced, pods, ranks), "WeightsSynced").status == "True"
    pods[1] = pod_for(base, 1, ready=False, restart_count=1)
    step = run(synced, pods, {**ranks, pods[1].name: worker(model_loaded=False, weights_version=None)}, minutes=1)
    assert _cond(step, "WeightsSynced").status == "False"
