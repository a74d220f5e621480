"""Idle sleep over several passes: a model woken after an idle sleep stays awake for the timeout, and a spec change
(`kubectl patch`) wakes a model that fell asleep for idleness, as a request does."""

from operator_fixtures import healthy, make_model, pod_for, run, with_status, worker

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import SleepRank, WakeRank


def _sleeps(result) -> int:
    return sum(1 for a in result.actions if isinstance(a, SleepRank))


def _wakes(result) -> int:
    return sum(1 for a in result.actions if isinstance(a, WakeRank))


def test_idle_sleep_then_a_patch_wakes_it_and_it_stays_awake_for_the_timeout():
    spec = {"sleep": {"idleTimeoutSeconds": 600}}
    model = make_model(spec)
    pods, _ = healthy(model)
    name = pods[0].name
    awake_idle = {name: worker(seconds_since_last_request=900.0)}
    first = run(model, pods, awake_idle)
    model = with_status(model, first)
    # Awake since the first pass: 10 minutes later it may sleep.
    result = run(model, pods, awake_idle, minutes=11)
    assert _sleeps(result) == 1
    model = with_status(model, result)
    asleep = {name: worker(asleep=True, level=1, seconds_since_last_request=1600.0)}
    result = run(model, pods, asleep, minutes=12)
    assert _wakes(result) == 0
    assert find_condition(result.status.conditions, "Sleeping").reason == "IdleTimeout"
    model = with_status(model, result)

    # kubectl patch: a new generation wakes it although no request came.
    patched = with_status(make_model(spec, generation=2), result)
    result = run(patched, pods, asleep, minutes=13)
    assert _wakes(result) == 1
    model = with_status(patched, result)
    awake_again = {name: worker(seconds_since_last_request=1700.0)}
    result = run(model, pods, awake_again, minutes=14)  # the wake is seen: Sleeping flips to False now
    assert _sleeps(result) == 0
    model = with_status(model, result)
    assert _sleeps(run(model, pods, awake_again, minutes=20)) == 0  # awake for 6 of the 10 minutes
    assert _sleeps(run(model, pods, awake_again, minutes=25)) == 1  # 11 minutes awake with no request


def test_a_rank_restarting_while_the_model_sleeps_for_idleness_does_not_wake_it():
    spec = {"replicas": 2, "sleep": {"idleTimeoutSeconds": 60}}
    model = make_model(spec)
    pods, _ = healthy(model)
    first, second = pods[0].name, pods[1].name
    model = with_status(model, run(model, pods, {p.name: worker(seconds_since_last_request=540.0) for p in pods}))
    result = run(model, pods, {p.name: worker(seconds_since_last_request=600.0) for p in pods}, minutes=10)
    assert _sleeps(result) == 2
    model = with_status(model, result)
    asleep = {p.name: worker(asleep=True, seconds_since_last_request=660.0) for p in pods}
    model = with_status(model, run(model, pods, asleep, minutes=11))

    # The second rank's process dies: its pod is not ready and its control API does not answer.
    restarting = [pods[0], pod_for(model, 1, ready=False)]
    result = run(model, restarting, {first: asleep[first]}, minutes=12)
    assert _wakes(result) == 0
    model = with_status(model, result)
    # It comes back awake, as a fresh process that has not seen a request: it is put back to sleep, the other stays.
    fresh = {
        first: worker(asleep=True, seconds_since_last_request=780.0),
        second: worker(seconds_since_last_request=None),
    }
    result = run(model, pods, fresh, minutes=13)
    assert _wakes(result) == 0 and [a.pod for a in result.actions if isinstance(a, SleepRank)] == [second]
    model = with_status(model, result)
    # A request still wakes it.
    asked = {first: worker(asleep=True, seconds_since_last_request=3.0), second: worker(asleep=True)}
    assert _wakes(run(model, pods, asked, minutes=14)) == 2


def _patched(model, spec, generation):
    """The model after `kubectl patch`: another spec and generation, the status as the last pass left it."""
    return make_model(spec, generation=generation).model_copy(update={"status": model.status})


def test_a_timeout_set_on_an_idle_model_waits_a_whole_timeout_from_then():
    # Awake and idle for an hour when the timeout is set: every clock the planner had (the workers', the Sleeping
    # condition's) is long past it, but the user just set it. It used to sleep in that very pass.
    model = make_model()
    pods, _ = healthy(model)
    idle = {pods[0].name: worker(seconds_since_last_request=3600.0)}
    model = with_status(model, run(model, pods, idle))
    timed = _patched(model, {"sleep": {"idleTimeoutSeconds": 600}}, generation=2)
    result = run(timed, pods, idle, minutes=60)
    assert _sleeps(result) == 0
    assert result.status.idle_clock is not None and result.status.idle_clock.seconds == 600
    model = with_status(timed, result)
    assert _sleeps(run(model, pods, idle, minutes=69)) == 0
    assert _sleeps(run(model, pods, idle, minutes=70)) == 1  # a whole timeout after it was set

    # Changing it counts again from the change; a request meanwhile counts as usual.
    model = with_status(model, run(model, pods, idle, minutes=65))
    shorter = _patched(model, {"sleep": {"idleTimeoutSeconds": 120}}, generation=3)
    result = run(shorter, pods, idle, minutes=66)
    assert _sleeps(result) == 0
    model = with_status(shorter, result)
    assert _sleeps(run(model, pods, idle, minutes=67)) == 0
    assert _sleeps(run(model, pods, idle, minutes=68)) == 1
    assert _sleeps(run(model, pods, {pods[0].name: worker(seconds_since_last_request=30.0)}, minutes=68)) == 0
