"""Planner: weight rolls (replica by replica, maxUnavailable, failure stops the roll) and sleep/wake."""

import pytest
from operator_fixtures import healthy, make_model, pod_for, pod_name, run, with_status, worker

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import SleepRank, UpdateWeights, WakeRank
from tidal.operator.planner.observed import UpdateFailure

V2 = {"weights": {"version": "v2", "source": "ckpt/v2"}}


def _cond(result, type_):
    cond = find_condition(result.status.conditions, type_)
    assert cond is not None
    return cond


def _updates(result):
    return [a for a in result.actions if isinstance(a, UpdateWeights)]


def _served_base(replicas: int, extra: dict | None = None):
    """A model on `base` everywhere, then the spec changed to v2 (status read back from the first pass)."""
    base = make_model({"replicas": replicas})
    pods, ranks = healthy(base)
    first = run(base, pods, ranks)
    model = with_status(make_model({"replicas": replicas, **V2, **(extra or {})}, generation=2), first)
    return model, pods, ranks


def test_roll_goes_replica_by_replica_and_serves_new_version_only_when_all_agree():
    model, pods, ranks = _served_base(3)
    step = run(model, pods, ranks, minutes=1)
    (update,) = _updates(step)
    assert update.pod == "tiny-r0-0" and update.version == "v2" and update.source == "/srv/models/ckpt/v2"
    assert step.status.phase == "Updating" and step.status.weights_version == "base"
    assert _cond(step, "WeightsSynced").reason == "RollingOut" and _cond(step, "Progressing").status == "True"
    for replica in (1, 2):
        ranks[pod_name(model, replica - 1)] = worker("v2", "sum-v2")
        model = with_status(model, step)
        step = run(model, pods, ranks, minutes=1 + replica)
        assert [u.pod for u in _updates(step)] == [pod_name(model, replica)]
        assert step.status.weights_version == "base"  # mixed versions: served version unchanged
    ranks[pod_name(model, 2)] = worker("v2", "sum-v2")
    done = run(with_status(model, step), pods, ranks, minutes=9)
    assert _updates(done) == []
    assert done.status.weights_version == "v2" and done.status.phase == "Ready"
    assert _cond(done, "WeightsSynced").status == "True"


def test_max_unavailable_counts_replicas_already_down():
    model, pods, ranks = _served_base(4, {"updateStrategy": {"maxUnavailable": 2}})
    assert [u.pod for u in _updates(run(model, pods, ranks))] == ["tiny-r0-0", "tiny-r1-0"]
    pods[3] = pod_for(model, 3, ready=False)  # one replica is not serving: only one more may go
    assert [u.pod for u in _updates(run(model, pods, ranks))] == ["tiny-r0-0"]


def test_failed_update_stops_the_roll_keeps_old_version_and_is_remembered():
    model, pods, ranks = _served_base(2)
    failure = UpdateFailure(version="v2", message="tensor model.norm.weight has shape [8], expected [64]")
    ranks[pod_name(model, 0)] = worker("base", "sum-base", update_failure=failure)
    step = run(model, pods, ranks, minutes=1)
    assert _updates(step) == []
    degraded = _cond(step, "Degraded")
    assert degraded.status == "True" and degraded.reason == "WeightsUpdateFailed"
    assert "expected [64]" in degraded.message and "base" in degraded.message
    assert step.status.weights_version == "base" and step.status.phase == "Degraded"
    assert step.status.weights_rollout is not None and step.status.weights_rollout.failed_version == "v2"
    # The worker forgets (e.g. restarted); status remembers, the roll stays stopped.
    ranks[pod_name(model, 0)] = worker("base", "sum-base")
    held = run(with_status(model, step), pods, ranks, minutes=2)
    assert _updates(held) == [] and _cond(held, "Degraded").reason == "WeightsUpdateFailed"
    # A new version in the spec starts a new roll.
    fixed = with_status(make_model({"replicas": 2, "weights": {"version": "v3", "source": "ckpt/v3"}}), held)
    again = run(fixed, pods, ranks, minutes=3)
    assert [u.version for u in _updates(again)] == ["v3"]
    assert _cond(again, "Degraded").status == "False" and again.status.weights_rollout is None


def test_checksum_mismatch_is_reported():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    ranks[pod_name(model, 1)] = worker("base", "sum-other")
    result = run(model, pods, ranks)
    assert _cond(result, "WeightsSynced").reason == "ChecksumMismatch"
    assert _cond(result, "Degraded").reason == "ChecksumMismatch"
    assert result.status.weights_version is None


def test_a_new_version_rolls_over_a_checksum_mismatch():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    ranks[pod_name(model, 1)] = worker("base", "sum-other")
    mismatched = with_status(model, run(model, pods, ranks))
    fixed = with_status(make_model({"replicas": 2, "weights": {"version": "v2", "source": "ckpt/v2"}}), mismatched)
    result = run(fixed, pods, ranks, minutes=1)
    assert [u.version for u in _updates(result)] == ["v2"]  # replica by replica (maxUnavailable 1)
    assert _cond(result, "WeightsSynced").reason == "RollingOut"
    assert _cond(result, "Degraded").status == "False"


def test_sleep_and_wake_touch_every_rank_in_one_pass():
    awake = make_model({"replicas": 3})
    pods, ranks = healthy(awake)
    asleep_spec = make_model({"replicas": 3, "sleep": {"state": "Asleep", "level": 2}})
    sleeps = [a for a in run(asleep_spec, pods, ranks).actions if isinstance(a, SleepRank)]
    assert sorted(s.pod for s in sleeps) == ["tiny-r0-0", "tiny-r1-0", "tiny-r2-0"] and {s.level for s in sleeps} == {2}
    sleeping = {name: worker(asleep=True, level=2) for name in ranks}
    result = run(asleep_spec, pods, sleeping)
    assert not any(isinstance(a, SleepRank) for a in result.actions)
    assert result.status.phase == "Sleeping" and result.status.sleep_state == "Asleep"
    assert _cond(result, "Sleeping").status == "True" and _cond(result, "Sleeping").reason == "Requested"
    assert _cond(result, "Ready").reason == "Asleep"
    wakes = [a for a in run(awake, pods, sleeping).actions if isinstance(a, WakeRank)]
    assert len(wakes) == 3


@pytest.mark.parametrize("state", ["Asleep", "Awake"])
def test_a_model_scaled_to_zero_says_it_has_no_rank_to_sleep_and_stays_quiet(state):
    # With no ranks nothing is falling asleep: "FallingAsleep, 0/0 ranks asleep" would never end.
    model = make_model({"replicas": 0, "sleep": {"state": state}})
    first = run(model, [], {})
    sleeping = _cond(first, "Sleeping")
    assert (sleeping.status, sleeping.reason, sleeping.message) == ("False", "ScaledToZero", "spec.replicas is 0")
    assert first.status.phase == "Stopped" and first.status.sleep_state == "None"
    assert not any(isinstance(a, SleepRank | WakeRank) for a in first.actions)
    assert run(with_status(model, first), [], {}, minutes=5).actions == []


def test_level_one_sleeper_is_deepened_to_level_two():
    model = make_model({"sleep": {"state": "Asleep", "level": 2}})
    pods, _ = healthy(model)
    result = run(model, pods, {pods[0].name: worker(asleep=True, level=1)})
    assert [a.level for a in result.actions if isinstance(a, SleepRank)] == [2]


def test_idle_timeout_sleeps_and_a_request_wakes():
    model = make_model({"replicas": 2, "sleep": {"idleTimeoutSeconds": 600}})
    pods, _ = healthy(model)
    busy = {p.name: worker(seconds_since_last_request=30.0) for p in pods}
    first = run(model, pods, busy)
    assert not any(isinstance(a, SleepRank) for a in first.actions)
    model = with_status(model, first)  # the timeout counts from this pass on
    idle = {p.name: worker(seconds_since_last_request=900.0) for p in pods}
    idle[pods[1].name] = worker(seconds_since_last_request=900.0, in_flight_requests=1)
    assert not any(isinstance(a, SleepRank) for a in run(model, pods, idle, minutes=11).actions)
    idle[pods[1].name] = worker(seconds_since_last_request=900.0)
    falling = run(model, pods, idle, minutes=11)
    assert len([a for a in falling.actions if isinstance(a, SleepRank)]) == 2
    model = with_status(model, falling)
    dozing = {p.name: worker(asleep=True, seconds_since_last_request=1200.0) for p in pods}
    result = run(model, pods, dozing, minutes=12)
    assert not any(isinstance(a, WakeRank) for a in result.actions)
    assert _cond(result, "Sleeping").reason == "IdleTimeout"
    dozing[pods[0].name] = worker(asleep=True, seconds_since_last_request=2.0)  # a request arrived
    assert len([a for a in run(model, pods, dozing, minutes=13).actions if isinstance(a, WakeRank)]) == 2


def test_roll_waits_while_asleep():
    model, pods, _ = _served_base(1, {"sleep": {"state": "Asleep"}})
    sleeping = {p.name: worker(asleep=True) for p in pods}
    result = run(model, pods, sleeping)
    assert _updates(result) == [] and _cond(result, "WeightsSynced").reason == "PausedWhileAsleep"


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeper_behind_the_desired_weights_gets_them_before_it_wakes(level):
    # Woken first, a rank would serve the old weights until the roll reached it (level 1 keeps them in host memory),
    # or read them from disk only to replace them (level 2 dropped them).
    model, pods, _ = _served_base(2)
    asleep = {p.name: worker(asleep=True, level=level) for p in pods}
    result = run(model, pods, asleep)
    assert not any(isinstance(a, WakeRank) for a in result.actions)
    assert [(u.pod, u.version, u.source) for u in _updates(result)] == [
        ("tiny-r0-0", "v2", "/srv/models/ckpt/v2"),
        ("tiny-r1-0", "v2", "/srv/models/ckpt/v2"),
    ]
    # The worker staged v2 while asleep: the next pass wakes it, with nothing left to roll.
    staged = {
        p.name: worker("v2", "sum-v2", asleep=True, level=level, weights_source="/srv/models/ckpt/v2") for p in pods
    }
    result = run(with_status(model, result), pods, staged)
    assert _updates(result) == [] and len([a for a in result.actions if isinstance(a, WakeRank)]) == 2


def test_a_sleeping_rank_whose_group_is_being_replaced_gets_the_update_before_its_wake():
    # Asleep on base; one edit asks for v2 and Awake while rank 1's pod is gone. Its replacement starts on v2, so
    # rank 0 woken on base would form a group on two versions: it takes v2 first.
    base = make_model({"expertParallel": 2})
    first = run(base, *healthy(base))
    model = with_status(make_model({"expertParallel": 2, **V2}, generation=2), first)
    rank0 = pod_for(model, 0, 0, group_port=7100, pod_ip="10.0.0.1")
    sleeping = {rank0.name: worker(asleep=True, level=1, rank=0, world_size=2)}
    result = run(model, [rank0], sleeping)
    assert [u.pod for u in _updates(result)] == ["tiny-r0-0"]
    assert not any(isinstance(a, WakeRank) for a in result.actions)
    # While an awake rank of the group still serves base (restarted in place), rank 0 wakes on base like it: the
    # group rolls whole once every rank is ready.
    rank1 = pod_for(model, 0, 1, group_port=7100, pod_ip="10.0.0.2")
    both = {**sleeping, rank1.name: worker(rank=1, world_size=2)}
    result = run(model, [rank0, rank1], both)
    assert _updates(result) == [] and [a.pod for a in result.actions if isinstance(a, WakeRank)] == ["tiny-r0-0"]


def test_a_sleeper_update_takes_no_unavailability_budget_and_an_awake_model_is_not_woken_by_it():
    # Asleep replicas serve nothing: each is updated before its wake, however many there are.
    model, pods, _ = _served_base(3, {"updateStrategy": {"maxUnavailable": 1}})
    asleep = {p.name: worker(asleep=True, level=2) for p in pods}
    assert len(_updates(run(model, pods, asleep))) == 3
    # While the model is to stay asleep nothing is read: the spec may change again before it wakes.
    sleeping, pods, _ = _served_base(3, {"sleep": {"state": "Asleep", "level": 2}})
    result = run(sleeping, pods, asleep)
    assert _updates(result) == [] and not any(isinstance(a, WakeRank) for a in result.actions)


def test_a_level_two_sleeper_wakes_on_its_weights_once_the_new_version_failed():
    model, pods, _ = _served_base(1)
    failed = UpdateFailure(version="v2", message="bad_checkpoint: shapes")
    deep = {pods[0].name: worker(asleep=True, level=2, update_failure=failed)}
    result = run(model, pods, deep)
    assert _updates(result) == [] and [a.pod for a in result.actions if isinstance(a, WakeRank)] == ["tiny-r0-0"]
    assert _cond(result, "WeightsSynced").reason == "UpdateFailed"


@pytest.mark.parametrize("level", [1, 2])
def test_sleepers_that_wake_on_a_request_get_new_weights_while_asleep(level):
    # TIDAL_ASLEEP_REQUESTS=wake: a request wakes the worker itself, before any pass could update it first; waking on
    # the old weights (level 1) or reloading them from disk (level 2) would serve what the spec no longer names.
    wakes = {"worker": {"env": [{"name": "TIDAL_ASLEEP_REQUESTS", "value": "wake"}]}}
    sleep = {"sleep": {"state": "Asleep", "level": level}}
    base = make_model({"replicas": 2, **wakes, **sleep})
    pods, _ = healthy(base)
    asleep = {p.name: worker(asleep=True, level=level) for p in pods}
    model = with_status(make_model({"replicas": 2, **wakes, **sleep, **V2}, generation=2), run(base, pods, asleep))
    result = run(model, pods, asleep)
    assert [u.pod for u in _updates(result)] == ["tiny-r0-0", "tiny-r1-0"]
    assert not any(isinstance(a, WakeRank | SleepRank) for a in result.actions)  # they stay asleep, on v2
    assert _cond(result, "WeightsSynced").reason != "PausedWhileAsleep"
    # Without the setting the roll waits for the wake, as before.
    plain = with_status(make_model({"replicas": 2, **sleep, **V2}, generation=2), run(base, pods, asleep))
    assert _updates(run(plain, pods, asleep)) == []


def test_a_roll_refused_by_one_replica_after_another_took_it_reports_what_each_serves():
    # Replica 0 took v2; replica 1 refused it. Replica 0 serves v2 now: the status must not say every rank keeps
    # serving base.
    model, pods, ranks = _served_base(2)
    first = run(model, pods, ranks, minutes=1)
    new_dir, old_dir = "/srv/models/ckpt/v2", "/srv/models/tiny-llama"
    ranks[pod_name(model, 0)] = worker("v2", "sum-v2", weights_source=new_dir)
    second = run(with_status(model, first), pods, ranks, minutes=2)
    assert [u.pod for u in _updates(second)] == [pod_name(model, 1)]
    refused = UpdateFailure(version="v2", message="bad_checkpoint: truncated", source=new_dir)
    ranks[pod_name(model, 1)] = worker("base", "sum-base", weights_source=old_dir, update_failure=refused)
    held = run(with_status(model, second), pods, ranks, minutes=3)
    assert [(r.pod, r.weights_version, r.weights_source) for r in held.status.ranks] == [
        ("tiny-r0-0", "v2", new_dir), ("tiny-r1-0", "base", old_dir)
    ]  # fmt: skip
    degraded = _cond(held, "Degraded")
    assert degraded.reason == "WeightsUpdateFailed" and "keep serving base" not in degraded.message
    assert "v2 on tiny-r0-0" in degraded.message and "base on tiny-r1-0" in degraded.message
    assert "1/2 ranks serve it" in _cond(held, "WeightsSynced").message
