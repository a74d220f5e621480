"""Restart policy, back-off, pod phase, conditions and probe thresholds (pure kubelet bookkeeping)."""

from tidal.devcluster.nodeagent.allocators import AddressPool, GpuPool, gpu_request, visible_devices
from tidal.devcluster.nodeagent.lifecycle import (
    ContainerRecord,
    backoff_delay,
    pod_conditions,
    pod_phase,
    should_restart,
    terminated_state,
)
from tidal.devcluster.nodeagent.probes import ProbeSpec, ProbeTracker, resolve_port


def running(name: str = "c") -> ContainerRecord:
    return ContainerRecord(name, "img", state={"running": {"startedAt": "t"}}, ready=True, started=True)


def exited(code: int, name: str = "c") -> ContainerRecord:
    return ContainerRecord(name, "img", state=terminated_state(code, "t0", "t1"))


def crash_looping(code: int) -> ContainerRecord:
    return ContainerRecord(
        "c",
        "img",
        restart_count=2,
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        last_state=terminated_state(code, "t0", "t1"),
    )


def test_restart_policy():
    assert should_restart("Always", 0) and should_restart("Always", 1)
    assert should_restart("OnFailure", 2) and not should_restart("OnFailure", 0)
    assert not should_restart("Never", 1)


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_delay(n, 1.0, 5.0) for n in range(5)] == [0.0, 1.0, 2.0, 4.0, 5.0]


def test_pod_phase_follows_the_kubelet():
    assert pod_phase([ContainerRecord("c", "img")], "Always") == "Pending"
    assert pod_phase([running()], "Never") == "Running"
    assert pod_phase([crash_looping(1)], "Always") == "Running"
    assert pod_phase([exited(0)], "OnFailure") == "Succeeded"
    assert pod_phase([exited(3)], "Never") == "Failed"
    assert pod_phase([crash_looping(3)], "OnFailure") == "Running"
    assert pod_phase([running("a"), exited(1, "b")], "Never") == "Running"
    assert pod_phase([exited(0, "a"), ContainerRecord("b", "img")], "Never") == "Pending"


def test_conditions_keep_transition_time_until_status_flips():
    first = pod_conditions([running()], "Running", [], [], "T1")
    ready = {c["type"]: c for c in first}["Ready"]
    assert ready["status"] == "True" and ready["lastTransitionTime"] == "T1"
    again = {c["type"]: c for c in pod_conditions([running()], "Running", [], first, "T2")}
    assert again["Ready"]["lastTransitionTime"] == "T1"
    unready = running()
    unready.ready = False
    flipped = {c["type"]: c for c in pod_conditions([unready], "Running", [], first, "T3")}
    assert flipped["Ready"]["status"] == "False" and flipped["Ready"]["lastTransitionTime"] == "T3"
    assert flipped["ContainersReady"]["message"] == "containers with unready status: [c]"


def _strategic_merge_conditions(stored: list[dict], patch: list[dict]) -> list[dict]:
    """What the API server does with a status patch's conditions (patchMergeKey type): keys merge, null deletes."""
    merged = {c["type"]: dict(c) for c in stored}
    for cond in patch:
        target = merged.setdefault(cond["type"], {})
        for key, value in cond.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    return list(merged.values())


def test_a_condition_that_turns_true_drops_the_reason_it_had_while_false():
    unready = running()
    unready.ready = False
    stored = _strategic_merge_conditions([], pod_conditions([unready], "Running", [], [], "T1"))
    now_ready = pod_conditions([running()], "Running", [], stored, "T2")
    stored = {c["type"]: c for c in _strategic_merge_conditions(stored, now_ready)}
    assert stored["Ready"]["status"] == "True"
    assert "reason" not in stored["Ready"] and "message" not in stored["Ready"], stored["Ready"]
    assert "reason" not in stored["ContainersReady"], stored["ContainersReady"]


def test_readiness_gates_hold_ready_until_their_condition_is_true():
    gated = {c["type"]: c for c in pod_conditions([running()], "Running", ["example.com/gate"], [], "T")}
    assert gated["ContainersReady"]["status"] == "True" and gated["Ready"]["status"] == "False"
    previous = [{"type": "example.com/gate", "status": "True"}]
    opened = {c["type"]: c for c in pod_conditions([running()], "Running", ["example.com/gate"], previous, "T")}
    assert opened["Ready"]["status"] == "True"


def test_probe_tracker_thresholds_and_timing():
    spec = ProbeSpec(
        "readiness",
        {"httpGet": {}},
        initial_delay_s=2,
        period_s=1,
        timeout_s=1,
        success_threshold=2,
        failure_threshold=3,
    )
    tracker = ProbeTracker(spec, container_started_at=10.0)
    assert not tracker.due(11.9) and tracker.due(12.0)
    tracker.record(True, "", 12.0)
    assert not tracker.succeeded and tracker.next_due == 13.0
    tracker.record(True, "", 13.0)
    assert tracker.succeeded
    for t in (14.0, 15.0):
        tracker.record(False, "x", t)
    assert tracker.succeeded and not tracker.failed  # below the failure threshold nothing changes
    tracker.record(False, "x", 16.0)
    assert tracker.failed and not tracker.succeeded


def test_named_probe_ports_resolve_from_the_container():
    container = {"ports": [{"name": "http", "containerPort": 8000}]}
    assert resolve_port("http", container) == 8000
    assert resolve_port(9000, container) == 9000


def test_address_pool_keeps_addresses_unique_and_honours_the_previous_one():
    pool = AddressPool(subnet=7)
    a, b = pool.assign("a"), pool.assign("b")
    assert a != b and a.startswith("127.0.7.") and pool.assign("a") == a
    assert pool.assign("c", wanted="127.0.7.200") == "127.0.7.200"
    assert pool.assign("d", wanted=a) not in (a, b, "127.0.7.200")  # taken: a fresh one instead
    pool.release("a")
    assert pool.assign("e") != a  # round robin: the released address is reused last


def test_gpu_pool_hands_out_distinct_indices():
    pool = GpuPool(4)
    pod = {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}
    assert gpu_request(pod) == 2
    assert pool.assign("x", 2) == [0, 1] and pool.assign("y", 2) == [2, 3]
    pool.release("x")
    assert pool.assign("z", 1) == [0]


def test_visible_devices_map_through_the_agents_own_list():
    assert visible_devices([0, 1], None) == "0,1"
    assert visible_devices([1], "4,5,6") == "5"
    assert visible_devices([], "4") == ""


def test_initialized_condition_follows_the_init_containers():
    waiting = {c["type"]: c for c in pod_conditions([ContainerRecord("c", "img")], "Pending", [], [], "T", False)}
    assert waiting["Initialized"]["status"] == "False"
    assert waiting["Initialized"]["reason"] == "ContainersNotInitialized"
    done = {c["type"]: c for c in pod_conditions([running()], "Running", [], [], "T", True)}
    assert done["Initialized"]["status"] == "True"


def test_status_composition_and_change_detection():
    from tidal.devcluster.nodeagent.podstatus import PodView, compose_status, same_status

    pod = {"spec": {"restartPolicy": "Never"}, "status": {}}
    init = exited(0, "setup")
    view = PodView([init], [running()], initialized=True, init_failed=False, pod_ip="127.0.3.1", start_time="T")
    status = compose_status(pod, view)
    assert status["phase"] == "Running" and status["podIP"] == "127.0.3.1"
    assert [s["name"] for s in status["initContainerStatuses"]] == ["setup"]
    assert same_status(compose_status(pod, view), status)  # only transition times could differ
    failing = PodView([exited(4, "setup")], [ContainerRecord("c", "img")], False, True, "127.0.3.1", "T")
    assert compose_status(pod, failing)["phase"] == "Failed"
    assert not same_status(compose_status(pod, failing), status)


def test_carry_over_from_an_earlier_agent():
    from tidal.devcluster.nodeagent.lifecycle import carry_over

    record = ContainerRecord("c", "img")
    carry_over(record, {"restartCount": 2, "state": {"running": {"startedAt": "S"}}}, "P")
    assert record.restart_count == 2
    assert record.last_state["terminated"]["exitCode"] == 137
    assert record.last_state["terminated"]["startedAt"] == "S"
