"""Planner: every spec change reaches the pods, whatever state they are in: a bad weights source is fixed by the
next spec (crash-looping pods are replaced), a broken replica does not hold the roll of the healthy ones, a pod
created while a roll is held as failed starts on the last weights that served, and a new source under the same
version rolls like a new version."""

from operator_fixtures import healthy, make_model, pod_for, pod_name, run, with_status, worker

from tidal.operator.api import worker_env as env
from tidal.operator.api.conditions import find_condition
from tidal.operator.builders.pod import build_pod
from tidal.operator.planner.actions import CreatePod, DeletePod, UpdateWeights
from tidal.operator.planner.observed import UpdateFailure, observe_pod

BASE_DIR = "/srv/models/tiny-llama"


def _weights(version: str, source: str, replicas: int = 2, generation: int = 1):
    return make_model({"replicas": replicas, "weights": {"version": version, "source": source}}, generation=generation)


def _crash_looping(model, replica: int, **over):
    """A pod built from `model` (so it starts on that model's weights) whose worker dies at start, again and again."""
    fields = {"ready": False, "waiting_reason": "CrashLoopBackOff", "restart_count": 4, "last_exit_code": 1}
    return pod_for(model, replica, **{**fields, **over})


def _cond(result, type_):
    cond = find_condition(result.status.conditions, type_)
    assert cond is not None
    return cond


def _of(result, kind):
    return [a for a in result.actions if isinstance(a, kind)]


def _start_env(create: CreatePod) -> tuple[str, str]:
    values = {e["name"]: e.get("value") for e in create.manifest["spec"]["containers"][0]["env"]}
    return values[env.WEIGHTS_VERSION], values[env.WEIGHTS_PATH]


def test_pods_crash_looping_on_a_bad_source_are_replaced_when_the_spec_is_fixed():
    bad = _weights("v1", "nowhere")
    pods = [_crash_looping(bad, 0), _crash_looping(bad, 1)]
    stuck = run(bad, pods, {})
    assert _cond(stuck, "Degraded").reason == "CrashLoop"
    assert _of(stuck, DeletePod) == []  # nothing better to start them on: they wait for a spec change

    fixed = with_status(_weights("v2", "ckpt/v2", generation=2), stuck)
    step = run(fixed, pods, {}, minutes=1)
    # Both at once: neither serves, so replacing them takes nothing out of service.
    assert [d.name for d in _of(step, DeletePod)] == ["tiny-r0-0", "tiny-r1-0"]
    assert "starts on weights v1 from /srv/models/nowhere" in _of(step, DeletePod)[0].reason
    assert _cond(step, "WeightsSynced").status == "False"

    gone = run(with_status(fixed, step), [], {}, minutes=2)
    creates = _of(gone, CreatePod)
    assert [_start_env(c) for c in creates] == [("v2", "/srv/models/ckpt/v2")] * 2


def test_a_pod_that_does_not_serve_is_replaced_only_when_it_would_start_on_other_weights():
    model = _weights("v2", "ckpt/v2", replicas=3)
    pods, ranks = healthy(model, "v2", "sum-v2")
    pods[0] = _crash_looping(model, 0)  # crashes on the desired weights: a new pod would do the same
    pods[1] = pod_for(make_model({"replicas": 3}), 1, ready=False)  # loading base, the spec asks for v2
    pods[2] = pod_for(make_model({"replicas": 3}), 2, ready=False)  # base too, but loaded: an update will reach it
    del ranks[pod_name(model, 0)], ranks[pod_name(model, 1)]
    ranks[pod_name(model, 2)] = worker("base", "sum-base")
    assert [d.name for d in _of(run(model, pods, ranks), DeletePod)] == ["tiny-r1-0"]


def test_a_broken_replica_does_not_hold_the_roll_of_the_healthy_one():
    base = make_model({"replicas": 2})
    pods, ranks = healthy(base)
    served = with_status(base, run(base, pods, ranks))
    model = with_status(_weights("v2", "ckpt/v2", generation=2), served)
    pods[1] = _crash_looping(model, 1)  # already on v2's start weights, and crashing for its own reasons
    del ranks[pod_name(model, 1)]
    step = run(model, pods, ranks, minutes=1)
    assert [(u.pod, u.version) for u in _of(step, UpdateWeights)] == [("tiny-r0-0", "v2")]
    assert _of(step, DeletePod) == []

    # maxUnavailable still bounds the replicas that serve: with three, the broken one does not free a second.
    base3 = make_model({"replicas": 3})
    pods3, ranks3 = healthy(base3)
    served3 = with_status(base3, run(base3, pods3, ranks3))
    model3 = with_status(_weights("v2", "ckpt/v2", replicas=3, generation=2), served3)
    pods3[2] = _crash_looping(model3, 2)
    del ranks3[pod_name(model3, 2)]
    assert [u.pod for u in _of(run(model3, pods3, ranks3, minutes=1), UpdateWeights)] == ["tiny-r0-0"]


def test_after_a_failed_roll_new_pods_start_on_the_last_weights_that_served_and_the_next_fix_reaches_all():
    base = make_model({"replicas": 2})
    pods, ranks = healthy(base)
    served = run(base, pods, ranks)
    assert served.status.weights_source == BASE_DIR
    bad = with_status(_weights("v2", "missing", generation=2), served)
    refused = UpdateFailure(version="v2", message="bad_checkpoint: no safetensors", source="/srv/models/missing")
    ranks[pod_name(bad, 0)] = worker("base", "sum-base", update_failure=refused)
    failed = run(bad, pods, ranks, minutes=1)
    assert _cond(failed, "WeightsSynced").reason == "UpdateFailed" and _of(failed, UpdateWeights) == []
    held = with_status(bad, failed)

    # Replica 1's pod is lost; the operator restarted meanwhile (the refusal is known from the status only).
    ranks = {pod_name(held, 0): worker("base", "sum-base")}
    recreated = _of(run(held, pods[:1], ranks, minutes=2), CreatePod)
    assert [_start_env(c) for c in recreated] == [("base", BASE_DIR)]

    # One created on v2 before the refusal was known crash-loops there: replaced by one on base.
    looping = [pods[0], _crash_looping(bad, 1)]
    step = run(held, looping, ranks, minutes=3)
    assert [d.name for d in _of(step, DeletePod)] == ["tiny-r1-0"]
    assert _cond(step, "Degraded").reason == "CrashLoop" and step.status.weights_version == "base"

    # A fixed version rolls in place into the replica on base, and replaces the crash-looping one meanwhile.
    fixed = with_status(_weights("v3", "ckpt/v3", generation=3), step)
    step = run(fixed, looping, ranks, minutes=4)
    assert [(u.pod, u.version) for u in _of(step, UpdateWeights)] == [("tiny-r0-0", "v3")]
    assert [d.name for d in _of(step, DeletePod)] == ["tiny-r1-0"]
    assert step.status.weights_rollout is None


def test_a_new_source_under_the_same_version_rolls_and_is_synced_only_when_every_rank_reports_it():
    old, new = "/srv/models/ckpt/v2", "/srv/models/ckpt/v2-fixed"
    model = _weights("v2", "ckpt/v2")
    pods, ranks = healthy(model, "v2", "sum-v2")
    for pod in pods:
        ranks[pod.name] = worker("v2", "sum-v2", weights_source=old)
    synced = run(model, pods, ranks)
    assert _cond(synced, "WeightsSynced").status == "True" and synced.status.weights_source == old

    moved = with_status(_weights("v2", "ckpt/v2-fixed", generation=2), synced)
    step = run(moved, pods, ranks, minutes=1)
    assert [(u.pod, u.version, u.source) for u in _of(step, UpdateWeights)] == [("tiny-r0-0", "v2", new)]
    assert _cond(step, "WeightsSynced").reason == "RollingOut" and step.status.weights_source == old
    assert [r.state for r in step.status.ranks] == ["Updating", "Updating"]

    ranks["tiny-r0-0"] = worker("v2", "sum-v2-fixed", weights_source=new + "/")  # spelt differently, same directory
    step = run(with_status(moved, step), pods, ranks, minutes=2)
    assert [u.pod for u in _of(step, UpdateWeights)] == ["tiny-r1-0"]
    assert _cond(step, "WeightsSynced").status == "False"

    ranks["tiny-r1-0"] = worker("v2", "sum-v2-fixed", weights_source=new)
    done = run(with_status(moved, step), pods, ranks, minutes=3)
    assert _of(done, UpdateWeights) == [] and _cond(done, "WeightsSynced").status == "True"
    assert done.status.weights_version == "v2" and done.status.weights_source == new


def test_a_refused_source_is_held_but_another_source_under_that_version_is_tried():
    model = _weights("v2", "ckpt/v2")
    pods, ranks = healthy(model, "base", "sum-base")
    refused = UpdateFailure(version="v2", message="bad_checkpoint: truncated", source="/srv/models/ckpt/v2")
    ranks["tiny-r0-0"] = worker("base", "sum-base", update_failure=refused)
    held = run(model, pods, ranks)
    assert held.status.weights_rollout is not None and held.status.weights_rollout.failed_source == refused.source
    ranks["tiny-r0-0"] = worker("base", "sum-base")
    assert _of(run(with_status(model, held), pods, ranks, minutes=1), UpdateWeights) == []
    retried = run(with_status(_weights("v2", "ckpt/v2-fixed", generation=2), held), pods, ranks, minutes=2)
    assert [u.source for u in _of(retried, UpdateWeights)] == ["/srv/models/ckpt/v2-fixed"]
    assert _cond(retried, "Degraded").status == "False"


def test_a_worker_that_does_not_report_its_source_is_taken_at_its_versions_word():
    model = _weights("v2", "ckpt/v2")
    pods, ranks = healthy(model, "v2", "sum-v2")  # no weights_source: a worker older than the field
    moved = with_status(_weights("v2", "ckpt/v2-fixed", generation=2), run(model, pods, ranks))
    result = run(moved, pods, ranks, minutes=1)
    assert _of(result, UpdateWeights) == [] and _cond(result, "WeightsSynced").status == "True"
    assert result.status.weights_source == "/srv/models/ckpt/v2-fixed"


def test_observe_pod_reads_the_weights_a_pod_starts_on():
    manifest = build_pod(_weights("v2", "ckpt/v2"), 0, 0)
    manifest["status"] = {"phase": "Pending"}
    pod = observe_pod(manifest, "tiny")
    assert pod is not None and pod.start_weights is not None
    assert (pod.start_version, pod.start_source) == ("v2", "/srv/models/ckpt/v2")
