"""Planner: pods the API server refuses (issue 16). Serving pods are never deleted for a pod it refuses, the model
is Degraded with the API server's message and says so in one Warning Event per refusal, and a fixed spec clears it."""

from datetime import UTC, datetime

import pytest
from operator_fixtures import OPERATOR, TOKEN, healthy, kinds, make_model, pod_for, run, with_status, worker

from tidal.operator.api.conditions import find_condition
from tidal.operator.builders.owner import spec_hash_of
from tidal.operator.builders.pod import build_pod
from tidal.operator.planner.actions import CreatePod, DeletePod, EmitEvent
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.observed import ObservedChildren
from tidal.operator.planner.pods import pods_to_check

RESOURCES = {"resources": {"cpu": "1", "memory": "2Gi"}}
LOTS = {
    **RESOURCES,
    "podTemplate": {"spec": {"containers": [{"name": "worker", "resources": {"limits": {"cpu": "lots"}}}]}},
}
DECODE = (
    'Pod in version "v1" cannot be handled as a Pod: quantities must match the regular expression '
    "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)


def _cond(result, type_):
    cond = find_condition(result.status.conditions, type_)
    assert cond is not None
    return cond


def _refusing(model, message=DECODE, replicas=None):
    """The API server's refusals of every pod `model` asks for (or only those of `replicas`)."""
    return {
        spec_hash_of(build_pod(model, r, k)): message
        for r in range(model.spec.replicas)
        for k in range(model.spec.expert_parallel)
        if replicas is None or r in replicas
    }


def _events(result):
    return [(a.type, a.reason) for a in result.actions if isinstance(a, EmitEvent)]


def _running(spec):
    """A model serving on `spec`, its status as the previous pass left it."""
    model = make_model(spec)
    pods, ranks = healthy(model)
    return with_status(model, run(model, pods, ranks)), pods, ranks


UNMERGEABLE = {  # the CRD keeps the template free-form, so these reach the operator
    "containers-null": ({"containers": None}, "gone (a null removes the key)"),
    "container-without-name": ({"containers": [{"image": "busybox"}]}, "an item that has no name"),
    "containers-a-map": ({"containers": {"worker": {"image": "x"}}}, "a dict, not a list"),
    # Inside a container too: Tidal's merge and spec hash read each container's env and the worker's ports.
    "env-item-without-name": (
        {"containers": [{"name": "worker", "env": [{"value": "x"}]}]},
        "containers[worker].env must be a list of variables that each have a name",
    ),
    "env-a-string": (
        {"containers": [{"name": "worker", "env": "A=1"}]},
        "containers[worker].env must be a list of variables that each have a name",
    ),
    "sidecar-env-without-name": (
        {"containers": [{"name": "worker"}, {"name": "proxy", "image": "p", "env": [{"value": "x"}]}]},
        "containers[proxy].env must be a list",
    ),
    "sidecar-env-null": (  # a null inside a new item is kept by the merge: it means no env, not a refusal
        {"containers": [{"name": "worker"}, {"name": "proxy", "image": "p", "env": None, "ports": [8080]}]},
        "containers[proxy].ports must be a list of ports",
    ),
    "kv-cache-sized-twice": (  # the worker refuses to start with both (exit 2): every pod would crash-loop
        {
            "containers": [
                {
                    "name": "worker",
                    "env": [
                        {"name": "TIDAL_NUM_KV_BLOCKS", "value": "64"},
                        {"name": "TIDAL_KV_CACHE_BYTES", "value": "1000000"},
                    ],
                }
            ]
        },
        "env sets both TIDAL_NUM_KV_BLOCKS and TIDAL_KV_CACHE_BYTES",
    ),
    "ports-not-maps": (
        {"containers": [{"name": "worker", "ports": [8080]}]},
        "containers[worker].ports must be a list of ports",
    ),
}


@pytest.mark.parametrize("case", sorted(UNMERGEABLE))
def test_a_template_the_merge_cannot_apply_is_refused_by_the_operator(case):
    template, says = UNMERGEABLE[case]
    before, pods, ranks = _running({"worker": RESOURCES})
    spec = {"worker": {**RESOURCES, "podTemplate": {"spec": template}}}
    changed = make_model(spec, generation=2).model_copy(update={"status": before.status})
    assert pods_to_check(_input(changed, pods, ranks)) == []  # nothing to dry-run
    result = run(changed, pods, ranks)
    assert not any(isinstance(a, DeletePod | CreatePod) for a in result.actions)  # the running pods serve on
    degraded = _cond(result, "Degraded")
    assert degraded.status == "True" and degraded.reason == "PodTemplateRefused"
    assert degraded.message.startswith("the operator refuses the pod the spec asks for") and says in degraded.message
    assert _cond(result, "Progressing").reason == "PodTemplateRefused"


def test_a_template_adding_the_other_kv_cache_size_to_the_spec_env_is_refused():
    """spec.worker.env may set one of the pair (the CRD refuses both there); the template's worker env the other."""
    before, pods, ranks = _running({"worker": RESOURCES})
    template = {"containers": [{"name": "worker", "env": [{"name": "TIDAL_KV_CACHE_BYTES", "value": "1000000"}]}]}
    worker = {**RESOURCES, "env": [{"name": "TIDAL_NUM_KV_BLOCKS", "value": "64"}], "podTemplate": {"spec": template}}
    changed = make_model({"worker": worker}, generation=2).model_copy(update={"status": before.status})
    result = run(changed, pods, ranks)
    assert not any(isinstance(a, DeletePod | CreatePod) for a in result.actions)
    degraded = _cond(result, "Degraded")
    assert (
        degraded.reason == "PodTemplateRefused" and "TIDAL_NUM_KV_BLOCKS and TIDAL_KV_CACHE_BYTES" in degraded.message
    )
    # One of the pair in either place alone is fine.
    alone = make_model({"worker": {**worker, "env": []}}, generation=2).model_copy(update={"status": before.status})
    assert any(isinstance(a, DeletePod | CreatePod) for a in run(alone, pods, ranks).actions)


def test_a_running_model_keeps_its_pods_when_the_new_template_is_refused():
    before, pods, ranks = _running({"worker": RESOURCES})
    changed = make_model({"worker": LOTS}, generation=2).model_copy(update={"status": before.status})
    result = run(changed, pods, ranks, refusals=_refusing(changed))
    assert not any(isinstance(a, DeletePod | CreatePod) for a in result.actions)
    degraded = _cond(result, "Degraded")
    assert degraded.status == "True" and degraded.reason == "PodTemplateRefused"
    assert "tiny-r0-0" in degraded.message and DECODE in degraded.message
    assert _cond(result, "Ready").status == "True"  # still serving
    assert (
        _cond(result, "Progressing").status == "False" and _cond(result, "Progressing").reason == "PodTemplateRefused"
    )
    assert result.status.phase == "Degraded" and result.status.observed_generation == 2
    assert _events(result) == [("Warning", "PodTemplateRefused")]
    # The next pass, with the same refusal: nothing to write, no second Event.
    again = run(with_status(changed, result), pods, ranks, minutes=1, refusals=_refusing(changed))
    assert again.actions == []


def test_the_old_spec_back_clears_degraded():
    before, pods, ranks = _running({"worker": RESOURCES})
    changed = make_model({"worker": LOTS}, generation=2).model_copy(update={"status": before.status})
    refused = run(changed, pods, ranks, refusals=_refusing(changed))
    fixed = make_model({"worker": RESOURCES}, generation=3).model_copy(update={"status": refused.status})
    result = run(fixed, pods, ranks, minutes=1)
    assert not any(isinstance(a, DeletePod | CreatePod) for a in result.actions)
    assert _cond(result, "Degraded").status == "False" and result.status.phase == "Ready"
    assert _events(result) == [("Normal", "AsExpected")]


def test_a_fixed_template_replaces_the_pods_as_usual():
    before, pods, ranks = _running({"worker": RESOURCES})
    changed = make_model({"worker": LOTS}, generation=2).model_copy(update={"status": before.status})
    refused = run(changed, pods, ranks, refusals=_refusing(changed))
    fixed_spec = {"worker": {**RESOURCES, "podTemplate": {"metadata": {"labels": {"team": "a"}}}}}
    fixed = make_model(fixed_spec, generation=3).model_copy(update={"status": refused.status})
    result = run(fixed, pods, ranks, minutes=1)
    assert [a.name for a in result.actions if isinstance(a, DeletePod)] == ["tiny-r0-0"]
    assert _cond(result, "Degraded").status == "False"


def test_a_new_model_with_a_refused_template_says_so_at_once():
    model = make_model({"worker": LOTS})
    result = run(model, [], {}, children=ObservedChildren(), refusals=_refusing(model))
    assert kinds(result)[:4] == ["CreateSecret", "CreateService", "CreateService", "CreateNetworkPolicy"]
    assert "CreatePod" not in kinds(result)
    degraded = _cond(result, "Degraded")
    assert degraded.status == "True" and degraded.reason == "PodTemplateRefused" and DECODE in degraded.message
    assert _cond(result, "Progressing").reason == "PodTemplateRefused"  # not "waiting for pods"
    assert _events(result) == [("Warning", "PodTemplateRefused")]


def test_another_refusal_is_another_event_and_the_same_one_is_not():
    model = make_model({"worker": LOTS})
    first = run(model, [], {}, refusals=_refusing(model))
    same = run(with_status(model, first), [], {}, minutes=1, refusals=_refusing(model))
    assert _events(same) == []
    other = run(with_status(model, first), [], {}, minutes=2, refusals=_refusing(model, "denied by policy"))
    assert _events(other) == [("Warning", "PodTemplateRefused")]
    assert "denied by policy" in _cond(other, "Degraded").message


def test_a_refusal_while_degraded_for_another_reason_is_posted():
    model = make_model({"worker": RESOURCES})
    looping = pod_for(model, 0, ready=False, waiting_reason="CrashLoopBackOff", restart_count=4)
    crashing = run(model, [looping], {})
    assert _cond(crashing, "Degraded").reason == "CrashLoop"
    changed = make_model({"worker": LOTS}, generation=2).model_copy(update={"status": crashing.status})
    result = run(changed, [looping], {}, refusals=_refusing(changed))
    assert _cond(result, "Degraded").reason == "PodTemplateRefused"
    assert _events(result) == [("Warning", "PodTemplateRefused")]
    assert not any(isinstance(a, DeletePod) for a in result.actions)


def test_a_refused_replica_keeps_its_pods_and_leaves_the_budget_to_the_next():
    old = make_model({"replicas": 2, "worker": RESOURCES})
    pods, ranks = healthy(old)
    new = make_model({"replicas": 2, "worker": {"resources": {"cpu": "2", "memory": "2Gi"}}})
    result = run(new, pods, ranks, refusals=_refusing(new, "exceeded quota", replicas={0}))
    assert [a.name for a in result.actions if isinstance(a, DeletePod)] == ["tiny-r1-0"]
    assert "tiny-r0-0" in _cond(result, "Degraded").message


def test_a_group_is_kept_whole_when_one_of_its_ranks_is_refused():
    spec = {"expertParallel": 2, "worker": RESOURCES}
    old = make_model(spec)
    pods, ranks = healthy(old)
    new = make_model({**spec, "worker": LOTS})
    refusals = {spec_hash_of(build_pod(new, 0, 1)): DECODE}
    result = run(new, pods, ranks, refusals=refusals)
    assert not any(isinstance(a, DeletePod) for a in result.actions)


def _input(model, pods, ranks):
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return PlanInput(
        model=model, pods=pods, ranks=ranks, children=ObservedChildren(), operator=OPERATOR, now=now,
        fresh_token=TOKEN,
    )  # fmt: skip


def test_pods_to_check_are_the_pods_a_pass_may_create():
    model = make_model({"replicas": 5, "worker": RESOURCES})
    old = make_model({"replicas": 5, "worker": {"resources": {"cpu": "2", "memory": "2Gi"}}})
    pods = [
        pod_for(model, 0),  # current
        pod_for(old, 1),  # outdated: replaced
        pod_for(model, 2),  # rejects the token: replaced with the same spec
        pod_for(model, 3, terminating=True),  # its name is taken: nothing yet
        # replica 4 has no pod: created
    ]
    ranks = {p.name: worker() for p in pods}
    ranks["tiny-r2-0"] = ranks["tiny-r2-0"].model_copy(update={"token_rejected": True})
    checks = pods_to_check(_input(model, pods, ranks))
    assert [(c.manifest["metadata"]["name"], c.replaces) for c in checks] == [
        ("tiny-r1-0", True), ("tiny-r2-0", True), ("tiny-r4-0", False),
    ]  # fmt: skip
    assert [c.spec_hash for c in checks] == [spec_hash_of(build_pod(model, r, 0)) for r in (1, 2, 4)]
    steady, steady_ranks = healthy(model)
    assert pods_to_check(_input(model, steady, steady_ranks)) == []


def test_the_message_names_a_few_pods_however_many_are_refused():
    model = make_model({"replicas": 64, "expertParallel": 64, "worker": LOTS})
    result = run(model, [], {}, refusals=_refusing(model, "x" * 8000))
    message = _cond(result, "Degraded").message
    assert "(tiny-r0-0, tiny-r0-1, tiny-r0-2 and 4093 more)" in message and len(message) < 8300
