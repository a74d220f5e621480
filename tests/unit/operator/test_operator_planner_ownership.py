"""Planner: objects under a child's name that the model does not control are never changed, and say so."""

from operator_fixtures import OPERATOR, T0, TOKEN, all_children, kinds, make_model, run

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import (
    CreatePod,
    CreateSecret,
    CreateService,
    DeletePod,
    EmitEvent,
    PatchSecret,
    PatchService,
    SetServingLabel,
)
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.observed import ObservedChildren, controlled_by, controller_of, sort_strangers
from tidal.operator.planner.pods import pods_to_check


def test_a_service_of_someone_else_under_the_serving_name_is_left_alone_and_reported():
    model = make_model({"replicas": 1})
    children = ObservedChildren(foreign={"Service/tiny": "Deployment/web"})
    result = run(model, [], {}, children=children)
    services = [a.manifest["metadata"]["name"] for a in result.actions if isinstance(a, CreateService | PatchService)]
    assert services == ["tiny-group"]  # its own headless Service is made; the foreign one is not touched
    assert any(isinstance(a, CreatePod) for a in result.actions)  # pods do not depend on that Service
    degraded = find_condition(result.status.conditions, "Degraded")
    assert degraded is not None and degraded.status == "True" and degraded.reason == "ForeignObject"
    assert "Service/tiny exists and is not this model's (Deployment/web)" in degraded.message
    assert result.status.phase == "Degraded"


def test_a_planted_token_secret_is_never_used_and_no_pod_mounts_it():
    model = make_model({"replicas": 2})
    children = ObservedChildren(foreign={"Secret/tiny-control-token": "no controller"})
    result = run(model, [], {}, children=children)
    assert not any(isinstance(a, CreateSecret | CreatePod) for a in result.actions), kinds(result)
    degraded = find_condition(result.status.conditions, "Degraded")
    assert degraded is not None and degraded.reason == "ForeignObject"
    assert "Secret/tiny-control-token" in degraded.message and "no controller" in degraded.message


def test_a_token_secret_of_this_models_that_holds_no_token_is_patched_and_a_planted_one_is_not():
    model = make_model()
    damaged = all_children(model).model_copy(update={"damaged": {"Secret/tiny-control-token"}})
    patches = [a for a in run(model, [], {}, children=damaged).actions if isinstance(a, PatchSecret)]
    assert [p.manifest["metadata"]["name"] for p in patches] == ["tiny-control-token"]
    assert patches[0].manifest["data"]["token"]  # the fresh token, as a missing Secret would be created with
    assert not any(isinstance(a, PatchSecret) for a in run(model, [], {}).actions)  # a good one stays
    planted = ObservedChildren(foreign={"Secret/tiny-control-token": "no controller"})
    assert not any(isinstance(a, PatchSecret) for a in run(model, [], {}, children=planted).actions)


def test_control_is_read_from_the_controller_owner_reference_only():
    owned = {"metadata": {"ownerReferences": [{"uid": "m", "kind": "InferenceModel", "name": "x", "controller": True}]}}
    merely_owned = {"metadata": {"ownerReferences": [{"uid": "m", "kind": "InferenceModel", "name": "x"}]}}
    assert controlled_by(owned, "m") and not controlled_by(owned, "n")
    assert not controlled_by(merely_owned, "m") and not controlled_by({"metadata": {}}, "m")
    assert controller_of(owned) == "InferenceModel/x" and controller_of(merely_owned) == "no controller"


def test_a_pod_of_someone_else_under_a_rank_name_is_left_alone_and_the_other_ranks_go_on():
    model = make_model({"replicas": 2})
    children = all_children(model).model_copy(update={"foreign": {"Pod/tiny-r1-0": "no controller"}})
    result = run(model, [], {}, children=children)
    created = [a.manifest["metadata"]["name"] for a in result.actions if isinstance(a, CreatePod)]
    assert created == ["tiny-r0-0"]  # a create under the taken name would fail for as long as that pod is there
    assert not any(isinstance(a, DeletePod | SetServingLabel) for a in result.actions), kinds(result)
    degraded = find_condition(result.status.conditions, "Degraded")
    assert degraded is not None and degraded.status == "True" and degraded.reason == "ForeignObject"
    assert "Pod/tiny-r1-0 exists and is not this model's (no controller)" in degraded.message
    warnings = [a for a in result.actions if isinstance(a, EmitEvent) and a.type == "Warning"]
    assert [e.reason for e in warnings] == ["ForeignObject"] and "Pod/tiny-r1-0" in warnings[0].message
    checks = pods_to_check(_input(model, children))
    assert [c.manifest["metadata"]["name"] for c in checks] == ["tiny-r0-0"]  # nor asked about


def test_a_pod_on_its_way_out_holds_its_name_without_blame():
    model = make_model({"replicas": 1})
    children = all_children(model).model_copy(update={"departing": {"tiny-r0-0"}})
    result = run(model, [], {}, children=children)
    assert not any(isinstance(a, CreatePod) for a in result.actions), kinds(result)
    degraded = find_condition(result.status.conditions, "Degraded")
    assert degraded is None or degraded.status == "False"


def test_many_foreign_pods_are_named_a_few_at_a_time():
    model = make_model({"replicas": 8})
    foreign = {f"Pod/tiny-r{r}-0": "no controller" for r in range(8)}
    result = run(model, [], {}, children=all_children(model).model_copy(update={"foreign": foreign}))
    assert not any(isinstance(a, CreatePod) for a in result.actions)
    degraded = find_condition(result.status.conditions, "Degraded")
    assert degraded is not None and "and 3 more" in degraded.message and "tiny-r7-0" not in degraded.message


def _pod(name: str, refs: list[dict] | None = None, terminating: bool = False) -> dict:
    meta: dict = {"name": name, "ownerReferences": refs}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta}


def test_strangers_are_foreign_unless_they_are_on_their_way_out():
    def model_ref(name: str) -> dict:
        return {"apiVersion": "tidal.dev/v1alpha1", "kind": "InferenceModel", "name": name, "controller": True}

    pods = [
        _pod("tiny-r0-0"),  # planted by hand
        _pod("tiny-r1-0", [model_ref("other")]),  # another model's
        _pod("tiny-r2-0", [model_ref("tiny")]),  # an earlier model named tiny, for the garbage collector
        _pod("tiny-r3-0", terminating=True),
    ]
    foreign, departing = sort_strangers(pods, "tiny")
    assert foreign == {"Pod/tiny-r0-0": "no controller", "Pod/tiny-r1-0": "InferenceModel/other"}
    assert departing == {"tiny-r2-0", "tiny-r3-0"}


def _input(model, children: ObservedChildren) -> PlanInput:
    return PlanInput(model=model, pods=[], ranks={}, children=children, operator=OPERATOR, now=T0, fresh_token=TOKEN)
