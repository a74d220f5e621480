"""Planner: children, pods, status bookkeeping and idempotence."""

from operator_fixtures import (
    OPERATOR,
    all_children,
    healthy,
    kinds,
    make_model,
    pod_for,
    pod_name,
    run,
    with_status,
    worker,
)

from tidal.operator.api.conditions import find_condition
from tidal.operator.builders.networkpolicy import OperatorIdentity, build_network_policy
from tidal.operator.planner.actions import CreatePod, DeletePod, EmitEvent, PatchStatus
from tidal.operator.planner.observed import ObservedChildren, RankObservation, observe_child, observe_pod


def _cond(result, type_):
    cond = find_condition(result.status.conditions, type_)
    assert cond is not None
    return cond


def test_first_pass_creates_everything_secret_first():
    model = make_model({"replicas": 2})
    result = run(model, [], {}, children=ObservedChildren())
    assert kinds(result) == [
        "CreateSecret",
        "CreateService",
        "CreateService",
        "CreateNetworkPolicy",
        "CreatePod",
        "CreatePod",
        "PatchStatus",
    ]
    assert result.status.phase == "Pending" and result.status.ready == "0/2"
    assert _cond(result, "Progressing").reason == "CreatingPods"
    assert _cond(result, "WeightsSynced").reason == "WaitingForRanks"


def test_steady_state_is_quiet_and_stable():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    first = run(model, pods, ranks)
    assert kinds(first)[0] == "PatchStatus"
    assert first.status.phase == "Ready" and first.status.weights_version == "base"
    assert _cond(first, "Ready").status == "True" and _cond(first, "WeightsSynced").status == "True"
    again = run(with_status(model, first), pods, ranks, minutes=5)
    assert again.actions == []  # nothing to do, and the status did not change (timestamps kept)


def test_drifted_children_are_patched():
    model = make_model()
    pods, ranks = healthy(model)
    old = make_model({"serving": {"port": 9000, "controlPort": 9001}})
    children = all_children(old)
    # The policy names the ports (it does not drift with them); it does with the operator's identity.
    moved = OperatorIdentity(namespace="tidal-old", pod_labels=OPERATOR.pod_labels)
    children.existing.update([observe_child(build_network_policy(model, moved))])
    result = run(model, pods, ranks, children=children)
    assert "PatchService" in kinds(result) and "PatchNetworkPolicy" in kinds(result)
    assert "CreateSecret" not in kinds(result)


def test_failed_pod_is_deleted_then_recreated():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    pods[1] = pod_for(model, 1, phase="Failed", ready=False)
    result = run(model, pods, ranks)
    deletes = [a for a in result.actions if isinstance(a, DeletePod)]
    assert [d.name for d in deletes] == ["tiny-r1-0"]
    gone = run(model, pods[:1], {pods[0].name: ranks[pods[0].name]})
    creates = [a for a in gone.actions if isinstance(a, CreatePod)]
    assert [c.manifest["metadata"]["name"] for c in creates] == ["tiny-r1-0"]


def test_terminating_pod_is_waited_for():
    model = make_model()
    result = run(model, [pod_for(model, 0, terminating=True, ready=False)], {})
    assert not any(isinstance(a, CreatePod | DeletePod) for a in result.actions)
    assert result.status.ranks[0].state == "Terminating"


def test_scale_down_deletes_extra_replicas():
    big = make_model({"replicas": 3})
    pods, ranks = healthy(big)
    result = run(make_model({"replicas": 1}), pods, ranks)
    assert sorted(a.name for a in result.actions if isinstance(a, DeletePod)) == ["tiny-r1-0", "tiny-r2-0"]


def test_scale_to_zero():
    result = run(make_model({"replicas": 0}), [], {})
    assert result.status.phase == "Stopped" and _cond(result, "Ready").reason == "ScaledToZero"


def test_outdated_pods_are_replaced_replica_by_replica():
    old = make_model({"replicas": 3})
    pods, ranks = healthy(old)
    new = make_model({"replicas": 3, "worker": {"image": "tidal-worker:2"}})
    result = run(new, pods, ranks)
    assert [a.name for a in result.actions if isinstance(a, DeletePod)] == ["tiny-r0-0"]
    # replica 0 is down (being replaced): nothing else may go while maxUnavailable is 1
    down = [pods[1], pods[2]]
    result = run(new, down, {p.name: ranks[p.name] for p in down})
    assert [a.manifest["metadata"]["name"] for a in result.actions if isinstance(a, CreatePod)] == ["tiny-r0-0"]
    assert not any(isinstance(a, DeletePod) for a in result.actions)


def test_crash_loop_is_degraded_with_reason_and_warning_event():
    model = make_model()
    pods, ranks = healthy(model)
    first = run(model, pods, ranks)
    looping = [
        pod_for(
            model,
            0,
            ready=False,
            restart_count=7,
            waiting_reason="CrashLoopBackOff",
            last_exit_message="CUDA out of memory",
        )
    ]
    result = run(with_status(model, first), looping, {}, minutes=1)
    degraded = _cond(result, "Degraded")
    assert degraded.status == "True" and degraded.reason == "CrashLoop"
    assert "restarted 7 times" in degraded.message and "CUDA out of memory" in degraded.message
    assert result.status.phase == "Degraded" and result.status.ranks[0].state == "Failed"
    events = [a for a in result.actions if isinstance(a, EmitEvent)]
    assert any(e.type == "Warning" and e.reason == "CrashLoop" for e in events)
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # recreating would not help


def test_status_patch_only_when_changed():
    model = make_model()
    pods, ranks = healthy(model)
    first = run(model, pods, ranks)
    assert any(isinstance(a, PatchStatus) for a in first.actions)
    ranks[pod_name(model, 0)] = worker(in_flight_requests=3)  # not part of status
    assert run(with_status(model, first), pods, ranks, minutes=2).actions == []


def test_observe_pod_reads_the_api_shape():
    manifest = {
        "metadata": {
            "name": "tiny-r0-0",
            "labels": {"tidal.dev/replica": "0", "tidal.dev/rank": "0"},
            "annotations": {"tidal.dev/spec-hash": "abc"},
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.3.4",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "worker",
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"reason": "Error", "message": "boom"}},
                }
            ],
        },
    }
    pod = observe_pod(manifest, "tiny")
    assert pod is not None and pod.ready and pod.terminating and pod.crash_looping
    assert pod.spec_hash == "abc" and pod.restart_count == 4 and pod.last_exit_message == "boom"
    assert pod.pod_ip == "127.0.3.4"
    assert pod.labels_edited  # no tidal.dev/model label
    assert observe_pod({"metadata": {"name": "stranger", "labels": {}}}, "tiny") is None
    odd = {"metadata": {"name": "odd", "labels": {"tidal.dev/replica": "x", "tidal.dev/rank": "0"}}}
    assert observe_pod(odd, "tiny") is None
    # The name says which rank a pod is; labels that no longer say the same are told, not trusted.
    for labels in ({}, {"tidal.dev/model": "tiny", "tidal.dev/replica": "x", "tidal.dev/rank": "1"}):
        edited = observe_pod({"metadata": {"name": "tiny-r2-1", "labels": labels}}, "tiny")
        assert edited is not None and (edited.replica, edited.rank, edited.labels_edited) == (2, 1, True)
    intact = {"tidal.dev/model": "tiny", "tidal.dev/replica": "2", "tidal.dev/rank": "1"}
    kept = observe_pod({"metadata": {"name": "tiny-r2-1", "labels": intact}}, "tiny")
    assert kept is not None and not kept.labels_edited
    assert observe_pod({"metadata": {"name": "tiny-r02-1", "labels": intact}}, "tiny") is None
    assert observe_pod({"metadata": {"name": "tiny-x-r2-1", "labels": intact}}, "tiny") is None


def test_pods_whose_worker_rejects_the_control_token_are_replaced_within_max_unavailable():
    # The token Secret was deleted (or edited) and re-created with a new token: running workers still hold the old
    # one and answer 401 to everything, so they can never be put to sleep or updated again until they restart.
    model = make_model({"replicas": 2})
    pods, _ = healthy(model)
    locked_out = {p.name: RankObservation(token_rejected=True) for p in pods}
    result = run(model, pods, locked_out)
    deletes = [a for a in result.actions if isinstance(a, DeletePod)]
    assert [d.name for d in deletes] == ["tiny-r0-0"]  # one replica at a time (maxUnavailable 1)
    assert "control token" in deletes[0].reason


def test_ranks_that_reject_the_token_show_so_and_keep_their_last_version_while_they_serve():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model, version="v1")
    model = with_status(model, run(model, pods, ranks))
    locked_out = {p.name: RankObservation(token_rejected=True) for p in pods}
    result = run(model, pods, locked_out)
    rows = {r.pod: r for r in result.status.ranks}
    # Not "Loading" with no version: both still serve v1, and one waits for its turn to be replaced.
    assert [(r.state, r.weights_version) for r in rows.values()] == [("Uncontrolled", "v1")] * 2
    assert result.status.ready == "2/2"
    again = run(with_status(model, result), pods, locked_out)  # the version outlives the pass that first lost it
    assert [r.weights_version for r in again.status.ranks] == ["v1", "v1"]
    fresh = run(model, pods, {p.name: RankObservation() for p in pods})  # silent, not refusing: nothing is known
    assert [(r.state, r.weights_version) for r in fresh.status.ranks] == [("Loading", None)] * 2
