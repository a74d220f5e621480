"""Planner: objects under a child's name that the model does not control are never changed, and say so."""

from operator_fixtures import kinds, make_model, run

from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import CreatePod, CreateSecret, CreateService, PatchService
from tidal.operator.planner.observed import ObservedChildren, controlled_by, controller_of


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


def test_control_is_read_from_the_controller_owner_reference_only():
    owned = {"metadata": {"ownerReferences": [{"uid": "m", "kind": "InferenceModel", "name": "x", "controller": True}]}}
    merely_owned = {"metadata": {"ownerReferences": [{"uid": "m", "kind": "InferenceModel", "name": "x"}]}}
    assert controlled_by(owned, "m") and not controlled_by(owned, "n")
    assert not controlled_by(merely_owned, "m") and not controlled_by({"metadata": {}}, "m")
    assert controller_of(owned) == "InferenceModel/x" and controller_of(merely_owned) == "no controller"
