"""Planner: a crash loop is Degraded from its first back-off until the container has run ready for the settle period,
one Event at each end, and its message quotes the container's last termination message."""

from datetime import timedelta

from operator_fixtures import OPERATOR, T0, TOKEN, all_children, healthy, make_model, pod_for, with_status, worker

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import DeletePod, EmitEvent
from tidal.operator.planner.crashloop import NAMED_PODS, QUOTED_CHARS, SETTLE_S
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.observed import observe_pod
from tidal.operator.planner.plan import Plan, plan

FATAL = "FileNotFoundError: weights directory /srv/models/nope does not exist"


def _at(model, pods, ranks, seconds: float) -> Plan:
    return plan(
        PlanInput(
            model=model,
            pods=pods,
            ranks=ranks,
            children=all_children(model),
            operator=OPERATOR,
            now=T0 + timedelta(seconds=seconds),
            fresh_token=TOKEN,
        )
    )


def _backing_off(model, restarts: int, message: str = FATAL):
    """The container died (its worker wrote `message`) and waits out its back-off."""
    return pod_for(
        model, 0, ready=False, restart_count=restarts, waiting_reason="CrashLoopBackOff",
        last_exit_code=1, last_exit_reason="Error", last_exit_message=message,
    )  # fmt: skip


def _running(model, restarts: int, started_s: float, ready_s: float | None = None):
    """Restarted at `started_s` (seconds after T0); ready since `ready_s` (None: not ready yet)."""
    return pod_for(
        model, 0, ready=ready_s is not None, restart_count=restarts,
        started_at=T0 + timedelta(seconds=started_s),
        ready_since=T0 + timedelta(seconds=ready_s) if ready_s is not None else None,
        last_exit_code=1, last_exit_reason="Error", last_exit_message=FATAL,
    )  # fmt: skip


def _degraded(result: Plan):
    cond = find_condition(result.status.conditions, "Degraded")
    assert cond is not None
    return cond


def _events(result: Plan) -> list[EmitEvent]:
    return [a for a in result.actions if isinstance(a, EmitEvent)]


def _walk(model, steps):
    """Run passes in order, each reading the status the one before wrote; (model, result, events) per step."""
    out = []
    for seconds, pods, ranks in steps:
        result = _at(model, pods, ranks, seconds)
        out.append((seconds, result, _events(result)))
        model = with_status(model, result)
    return out


def test_a_crash_loop_stays_degraded_across_back_off_cycles_with_one_event_each_way():
    model = make_model()
    pods, ranks = healthy(model)
    name = pods[0].name
    loaded = {name: worker()}
    steps = [
        (0, pods, ranks),
        (10, [_backing_off(model, 1)], {}),
        (12, [_running(model, 1, started_s=11)], {}),  # running again, loading
        (15, [_backing_off(model, 2)], {}),
        (19, [_running(model, 2, started_s=18)], {}),
        (25, [_backing_off(model, 3)], {}),
        (34, [_running(model, 3, started_s=33, ready_s=35)], loaded),  # this time it loads and turns ready
        (35 + SETTLE_S - 1, [_running(model, 3, started_s=33, ready_s=35)], loaded),
        (35 + SETTLE_S, [_running(model, 3, started_s=33, ready_s=35)], loaded),
    ]
    walked = _walk(model, steps)
    first = _degraded(walked[1][1])
    assert first.status == "True" and first.reason == "CrashLoop"
    for seconds, result, _ in walked[1:-1]:
        cond = _degraded(result)
        assert (cond.status, cond.reason, cond.last_transition_time) == (
            "True",
            "CrashLoop",
            first.last_transition_time,
        )
        assert result.status.phase == "Degraded", seconds
    # The message follows the loop without flipping the condition.
    assert "restarted 3 times" in _degraded(walked[-2][1]).message
    settled = _degraded(walked[-1][1])
    assert (settled.status, settled.reason) == ("False", "AsExpected")
    assert walked[-1][1].status.phase == "Ready"
    events = {seconds: [(e.type, e.reason) for e in evs] for seconds, _, evs in walked}
    # One Warning when the loop starts (beside Ready and WeightsSynced turning False), one Normal when it is over;
    # what the other conditions do inside the loop (Ready and WeightsSynced turned True at 34 s) is not news.
    assert ("Warning", "CrashLoop") in events[10]
    assert all(not events[seconds] for seconds, _, _ in walked[2:-1])
    assert events[35 + SETTLE_S] == [("Normal", "AsExpected")]


def test_a_container_ready_again_then_crashing_is_the_same_loop():
    model = make_model()
    name = pod_for(model, 0).name
    loaded = {name: worker()}
    walked = _walk(
        model,
        [
            (0, [_backing_off(model, 1)], {}),
            (5, [_running(model, 1, started_s=2, ready_s=4)], loaded),
            (30, [_backing_off(model, 2)], {}),  # died 26 s after turning ready: within the settle period
            (40, [_running(model, 2, started_s=38, ready_s=39)], loaded),
        ],
    )
    assert [_degraded(r).status for _, r, _ in walked] == ["True"] * 4
    # Ready and WeightsSynced went on and off with it: only the loop's start is an Event.
    assert [e.reason for _, _, evs in walked for e in evs] == ["CrashLoop"]


def test_the_settle_period_counts_from_ready_not_from_the_start():
    model = make_model()
    loaded = {pod_for(model, 0).name: worker()}
    looping = with_status(model, _at(model, [_backing_off(model, 4)], {}, 0))
    # Started long ago, but loading took most of that: ready for less than the settle period.
    slow = _running(model, 4, started_s=10, ready_s=10 + SETTLE_S)
    assert _degraded(_at(looping, [slow], loaded, 10 + SETTLE_S + 30)).status == "True"
    assert _degraded(_at(looping, [slow], loaded, 10 + 2 * SETTLE_S)).status == "False"


def test_an_operator_restart_keeps_the_loop_from_the_status_and_the_pod():
    # A new operator process knows only the object's status and what the pod reports now.
    model = make_model()
    looping = with_status(model, _at(model, [_backing_off(model, 5)], {}, 0))
    result = _at(looping, [_running(model, 5, started_s=40)], {}, 42)
    assert _degraded(result).status == "True" and not _events(result)
    assert _degraded(result).last_transition_time == T0


def test_a_replaced_pod_ends_the_loop_and_a_lone_restart_is_no_loop():
    model = make_model()
    looping = with_status(model, _at(model, [_backing_off(model, 5)], {}, 0))
    fresh = pod_for(model, 0, ready=False, started_at=T0 + timedelta(seconds=8))  # a new pod: no restarts
    assert _degraded(_at(looping, [fresh], {}, 10)).status == "False"
    # Restarted at once after one crash (no back-off seen), never in a loop: not Degraded.
    calm = with_status(model, _at(model, *healthy(model), 0))
    assert _degraded(_at(calm, [_running(model, 1, started_s=5)], {}, 10)).status == "False"


def test_the_message_quotes_the_termination_message_with_exit_code_and_reason():
    model = make_model()
    result = _at(model, [_backing_off(model, 3)], {}, 0)
    message = _degraded(result).message
    assert message == f"tiny-r0-0 keeps crashing (tiny-r0-0 restarted 3 times; last exit code 1 (Error): {FATAL})"
    warning = _events(result)[0]
    assert warning.type == "Warning" and FATAL in warning.message
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # a new pod would crash the same way
    huge = _degraded(_at(model, [_backing_off(model, 3, "x" * 10_000)], {}, 0)).message
    assert "x" * (QUOTED_CHARS - 1) + "…" in huge and "x" * QUOTED_CHARS not in huge


def test_many_crashing_pods_are_counted_past_the_first_few():
    model = make_model({"replicas": NAMED_PODS + 3})
    pods = [
        pod_for(model, r, ready=False, restart_count=2 + r, waiting_reason="CrashLoopBackOff", last_exit_code=137)
        for r in range(NAMED_PODS + 3)
    ]
    message = _degraded(_at(model, pods, {}, 0)).message
    assert message.startswith("tiny-r0-0, tiny-r1-0, tiny-r2-0, tiny-r3-0, tiny-r4-0 and 3 more keep crashing")
    assert f"(tiny-r{NAMED_PODS + 2}-0 restarted {NAMED_PODS + 4} times; last exit code 137)" in message


def test_observe_pod_reads_the_last_termination_and_when_the_pod_turned_ready():
    manifest = {
        "metadata": {"name": "tiny-r0-0", "labels": {"tidal.dev/replica": "0", "tidal.dev/rank": "0"}},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T12:00:30Z"}],
            "containerStatuses": [
                {
                    "name": "worker",
                    "restartCount": 2,
                    "state": {"running": {"startedAt": "2026-01-01T12:00:20Z"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": FATAL}},
                }
            ],
        },
    }
    pod = observe_pod(manifest, "tiny")
    assert pod is not None and not pod.terminated
    assert (pod.last_exit_code, pod.last_exit_reason, pod.last_exit_message) == (2, "Error", FATAL)
    assert pod.started_at == T0 + timedelta(seconds=20) and pod.ready_since == T0 + timedelta(seconds=30)
    # Ended now (before the kubelet restarts it): the current state wins over lastState.
    manifest["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1, "reason": "OOMKilled"}}
    manifest["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    ended = observe_pod(manifest, "tiny")
    assert ended is not None and ended.terminated and not ended.ready and ended.ready_since is None
    assert (ended.last_exit_code, ended.last_exit_reason, ended.last_exit_message) == (1, "OOMKilled", None)


def test_a_first_crash_seen_ended_is_not_a_loop_but_a_second_is():
    # The kubelet restarts a first crash at once; a pass may still catch its container ended (exit 137, restarted
    # 0 times). Calling that a loop held Degraded=CrashLoop for the whole settle period after one SIGKILL.
    model = make_model()
    ended = pod_for(model, 0, ready=False, terminated=True, restart_count=0, last_exit_code=137)
    assert _degraded(_at(model, [ended], {}, 1.0)).reason != "CrashLoop"
    again = pod_for(model, 0, ready=False, terminated=True, restart_count=1, last_exit_code=137)
    assert _degraded(_at(model, [again], {}, 1.0)).reason == "CrashLoop"
