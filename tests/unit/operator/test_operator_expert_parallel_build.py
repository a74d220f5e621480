"""The static half of expert parallelism: spec.experts and its rules, the group's env, port and serving label on
the pods, the Service that selects serving ranks, the NetworkPolicy between ranks, and the Service patch."""

import asyncio
import json
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
from crd_schema_check import check_object
from invalid_objects import VALID
from operator_fixtures import OPERATOR, make_model
from pydantic import ValidationError

from tidal.operator.api import constants as c
from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import pod as pod_builder
from tidal.operator.builders.networkpolicy import build_network_policy
from tidal.operator.builders.pod import build_pod
from tidal.operator.builders.services import build_serving_service
from tidal.operator.kube.client import MERGE_PATCH, KubeApi
from tidal.operator.kube.merge_patch import service_patch
from tidal.operator.schema.crd import openapi_schema

SCHEMA = openapi_schema()
GROUP_ENV = ("TIDAL_GROUP_HOST", "TIDAL_GROUP_PORT", "TIDAL_GROUP_TIMEOUT_S", "TIDAL_REDUNDANT_EXPERTS_PER_RANK")


def _object(**spec: Any) -> dict[str, Any]:
    return {**VALID, "spec": {**VALID["spec"], **spec}}


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def _ports(pod: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}


def _hash(manifest: dict[str, Any]) -> str:
    return str(manifest["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH])


# -- spec -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"expertParallel": 4},
        {"expertParallel": 64, "experts": {"redundantExpertsPerRank": 256, "collectiveTimeoutSeconds": 600}},
        {"expertParallel": 3, "experts": {"collectiveTimeoutSeconds": 0.25}},
        # Settings that matter only to groups are accepted (and unused) with one rank per replica.
        {"expertParallel": 1, "experts": {"redundantExpertsPerRank": 2, "collectiveTimeoutSeconds": 3}},
        # The group port is free to take when there is no group.
        {"expertParallel": 1, "serving": {"port": 7100, "controlPort": 7101}},
    ],
    ids=["ep4", "upper-bounds", "subsecond-deadline", "experts-with-ep1", "port-7100-with-ep1"],
)
def test_expert_parallel_objects_are_accepted_by_both(spec):
    obj = _object(**spec)
    InferenceModel.model_validate(obj)
    assert check_object(SCHEMA, obj) == []


def test_experts_defaults_in_pydantic_and_in_the_crd():
    experts = make_model({"expertParallel": 2}).spec.experts
    assert experts.redundant_experts_per_rank == 0 and experts.collective_timeout_seconds == 10.0
    node = SCHEMA["properties"]["spec"]["properties"]["experts"]
    assert node["default"] == {"redundantExpertsPerRank": 0, "collectiveTimeoutSeconds": 10.0}


def test_collective_timeout_is_a_number_of_seconds_not_a_bool():
    with pytest.raises(ValidationError, match="valid number"):
        make_model({"experts": {"collectiveTimeoutSeconds": True}})


def test_the_group_port_rule_names_the_port_and_why():
    with pytest.raises(ValidationError) as err:
        make_model({"expertParallel": 2, "serving": {"controlPort": c.GROUP_PORT}})
    assert "must not be 7100 when expertParallel is above 1: the ranks of a group reach each other" in str(err.value)


# -- pods -------------------------------------------------------------------------------------------------------


def test_a_rank_of_a_group_gets_the_group_settings_its_port_and_starts_out_of_the_service():
    model = make_model(
        {"expertParallel": 4, "experts": {"redundantExpertsPerRank": 2, "collectiveTimeoutSeconds": 2.5}}
    )
    pod = build_pod(model, replica=1, rank=3)
    env = _env(pod)
    assert env["TIDAL_GROUP_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["TIDAL_GROUP_PORT"] == "7100" and env["TIDAL_GROUP_TIMEOUT_S"] == "2.5"
    assert env["TIDAL_REDUNDANT_EXPERTS_PER_RANK"] == "2"
    assert env["TIDAL_WORLD_SIZE"] == "4" and env["TIDAL_RANK"] == "3" and env["TIDAL_REPLICA"] == "1"
    assert _ports(pod) == {"serve": 8000, "control": 8001, "group": 7100}
    labels = pod["metadata"]["labels"]
    assert labels[c.LABEL_SERVING] == "false" and labels[c.LABEL_LEADER] == "false" and labels[c.LABEL_RANK] == "3"
    assert build_pod(model, 1, 0)["metadata"]["labels"][c.LABEL_LEADER] == "true"
    # A whole number of seconds reads as a float too (the worker's option is a float).
    assert _env(build_pod(make_model({"expertParallel": 2}), 0, 0))["TIDAL_GROUP_TIMEOUT_S"] == "10.0"


def test_a_pod_of_expert_parallel_one_is_what_it_was_before_groups():
    model = make_model({"experts": {"redundantExpertsPerRank": 3}})
    pod = build_pod(model, 0, 0)
    assert not set(GROUP_ENV) & set(_env(pod))
    assert _ports(pod) == {"serve": 8000, "control": 8001}
    assert pod["metadata"]["labels"][c.LABEL_SERVING] == "true"
    # spec.experts means nothing without a group, so changing it replaces no pod.
    assert _hash(pod) == _hash(build_pod(make_model(), 0, 0))


def test_the_serving_label_does_not_count_in_the_spec_hash(monkeypatch):
    """The planner flips the label on live pods; a pod built with the other value must have the same hash."""
    for spec, rank in (({}, 0), ({"expertParallel": 3}, 1)):
        model = make_model(spec)
        before = build_pod(model, 0, rank)
        monkeypatch.setattr(pod_builder, "serving_at_creation", lambda s: s.is_expert_parallel)  # the opposite
        after = build_pod(model, 0, rank)
        monkeypatch.undo()
        assert before["metadata"]["labels"][c.LABEL_SERVING] != after["metadata"]["labels"][c.LABEL_SERVING]
        assert _hash(before) == _hash(after)


def test_group_settings_shape_a_rank_so_changing_them_replaces_it():
    base = _hash(build_pod(make_model({"expertParallel": 2}), 0, 0))
    assert _hash(build_pod(make_model({"expertParallel": 2, "experts": {"redundantExpertsPerRank": 1}}), 0, 0)) != base
    timeout = {"expertParallel": 2, "experts": {"collectiveTimeoutSeconds": 5}}
    assert _hash(build_pod(make_model(timeout), 0, 0)) != base


def test_the_pod_template_cannot_take_the_group_port_or_its_variables():
    template = {
        "metadata": {"labels": {c.LABEL_SERVING: "true"}},
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "ports": [{"name": "group", "containerPort": 9999}, {"name": "metrics", "containerPort": 9090}],
                    "env": [{"name": "TIDAL_GROUP_BACKEND", "value": "gloo"}],
                }
            ]
        },
    }
    model = make_model({"expertParallel": 2, "worker": {"podTemplate": template}})
    pod = build_pod(model, 0, 0)
    assert _ports(pod) == {"serve": 8000, "control": 8001, "group": 7100, "metrics": 9090}
    env = _env(pod)
    assert env["TIDAL_GROUP_PORT"] == "7100" and env["TIDAL_GROUP_BACKEND"] == "gloo"  # a tunable passes through
    assert pod["metadata"]["labels"][c.LABEL_SERVING] == "false"  # Tidal's labels win


# -- Service ----------------------------------------------------------------------------------------------------


def test_the_serving_service_selects_serving_ranks_whatever_the_group_size():
    one, four = build_serving_service(make_model()), build_serving_service(make_model({"expertParallel": 4}))
    assert one["spec"]["selector"] == {c.LABEL_MODEL: "tiny", c.LABEL_SERVING: "true"}
    assert one == four  # resizing a model never touches its Service
    # Every pod of expertParallel 1 is built serving, so it stays behind the Service as before.
    pods = [build_pod(make_model({"replicas": 2}), r, 0) for r in range(2)]
    assert all(p["metadata"]["labels"].items() >= one["spec"]["selector"].items() for p in pods)


def test_a_service_patch_removes_selector_keys_of_an_older_selector():
    desired = build_serving_service(make_model())
    live = {"spec": {"selector": {c.LABEL_MODEL: "tiny", c.LABEL_LEADER: "true"}, "clusterIP": "10.0.0.7"}}
    body = service_patch(desired, live)
    assert body["spec"]["selector"] == {c.LABEL_MODEL: "tiny", c.LABEL_SERVING: "true", c.LABEL_LEADER: None}
    assert desired["spec"]["selector"] == {c.LABEL_MODEL: "tiny", c.LABEL_SERVING: "true"}  # not modified
    assert service_patch(desired, {"spec": {"selector": dict(desired["spec"]["selector"])}}) is desired
    assert service_patch(desired, None) is desired  # gone meanwhile: the patch itself will say so


class _FakeCore:
    def __init__(self, live: dict[str, Any]) -> None:
        self.live = live
        self.patches: list[tuple[Any, ...]] = []

    def read_namespaced_service(self, name: str, namespace: str, **_: Any) -> Any:
        return SimpleNamespace(data=json.dumps(self.live).encode())

    def read_namespaced_secret(self, name: str, namespace: str, **_: Any) -> Any:
        raise AssertionError("a Service patch reads no Secret")

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        raise AssertionError("a Service patch reads no Pod")

    def patch_namespaced_secret(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        raise AssertionError("a Service patch writes no Secret")

    def patch_namespaced_service(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        self.patches.append((name, namespace, body, kwargs["_content_type"]))
        return SimpleNamespace(data=b"{}")


def test_the_client_patches_a_service_to_exactly_the_built_selector():
    api = KubeApi(MagicMock(), "test")
    core = _FakeCore({"spec": {"selector": {c.LABEL_MODEL: "tiny", c.LABEL_LEADER: "true"}}})
    api.core = core  # type: ignore[assignment]
    try:
        asyncio.run(api.patch(build_serving_service(make_model())))
    finally:
        api.close()
    ((name, namespace, body, content_type),) = core.patches
    assert (name, namespace, content_type) == ("tiny", "ml", MERGE_PATCH)
    assert body["spec"]["selector"] == {c.LABEL_MODEL: "tiny", c.LABEL_SERVING: "true", c.LABEL_LEADER: None}


# -- NetworkPolicy ----------------------------------------------------------------------------------------------


def test_ranks_of_a_group_reach_each_other_on_every_tcp_port():
    policy = build_network_policy(make_model({"expertParallel": 3}), OPERATOR)
    open_rule, control_rule, ranks_rule = policy["spec"]["ingress"]
    assert open_rule["ports"] == [{"protocol": "TCP", "port": "serve"}]  # each pod's own serving port
    assert control_rule["ports"] == [{"protocol": "TCP", "port": "control"}]
    # Only pods of this model, in the policy's own namespace (no namespaceSelector), on any TCP port (no port number:
    # gloo connects to ephemeral ports besides the group port).
    assert ranks_rule == {
        "from": [{"podSelector": {"matchLabels": {c.LABEL_MODEL: "tiny"}}}],
        "ports": [{"protocol": "TCP"}],
    }
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_without_a_group_the_policy_stays_as_tight_as_before():
    one = build_network_policy(make_model(), OPERATOR)
    assert len(one["spec"]["ingress"]) == 2
    assert _hash(one) == _hash(build_network_policy(make_model({"experts": {"redundantExpertsPerRank": 1}}), OPERATOR))
    assert _hash(one) != _hash(build_network_policy(make_model({"expertParallel": 2}), OPERATOR))
