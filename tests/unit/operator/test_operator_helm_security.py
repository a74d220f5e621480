"""The chart's security switches: the two RBAC scopes (and the operator watching what they grant), and the
pod-template ValidatingAdmissionPolicy, whose CEL is evaluated here with cel-python on models it must refuse or let
through (tests/e2e/test_operator_pod_template_policy.py checks the same on a real API server)."""

import functools
import subprocess
from typing import Any

import celpy
import pytest
from test_operator_helm_chart import CHART, HELM, _by_kind, _template

from tidal.operator.config import OperatorConfig
from tidal.operator.schema.crd import build_crd

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built (hack/build-binaries.sh); CI has it")

NAMESPACES = ("--set", "rbac.scope=namespaces", "--set", "watchNamespaces={ml,research}")
RESTRICT = ("--set", "podTemplatePolicy.restrict=true")


def _operator_config(docs: list[dict]) -> OperatorConfig:
    (deploy,) = _by_kind(docs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return OperatorConfig.from_env({**env, "TIDAL_OPERATOR_NAMESPACE": "tidal-system"})


def _model_rules(role: dict) -> set[str]:
    return {resource for rule in role["rules"] for resource in rule["resources"]}


def test_cluster_scope_is_the_default_and_watches_every_namespace():
    docs = _template()
    assert _operator_config(docs).watch_namespaces == []
    names = [r["metadata"]["name"] for r in _by_kind(docs, "ClusterRole")]
    assert names == ["tidal-operator-crd-reader", "tidal-operator"]
    assert [r["metadata"]["name"] for r in _by_kind(docs, "Role")] == ["tidal-operator-leader-election"]


def test_namespaces_scope_grants_and_watches_the_listed_namespaces_only():
    cluster = _template()
    docs = _template(*NAMESPACES)
    assert _operator_config(docs).watch_namespaces == ["ml", "research"]
    # The one cluster-wide grant left: reading CRDs, which are cluster-scoped.
    (crd_reader,) = _by_kind(docs, "ClusterRole")
    assert _model_rules(crd_reader) == {"customresourcedefinitions"}
    assert [b["roleRef"]["name"] for b in _by_kind(docs, "ClusterRoleBinding")] == ["tidal-operator-crd-reader"]
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in _by_kind(docs, "Role")}
    assert set(roles) == {
        ("ml", "tidal-operator"),
        ("research", "tidal-operator"),
        ("tidal-system", "tidal-operator-leader-election"),
    }
    # Each watched namespace gets exactly what the ClusterRole grants in cluster scope.
    (cluster_role,) = [r for r in _by_kind(cluster, "ClusterRole") if r["metadata"]["name"] == "tidal-operator"]
    for ns in ("ml", "research"):
        assert roles[(ns, "tidal-operator")]["rules"] == cluster_role["rules"]
    bindings = {
        (b["metadata"]["namespace"], b["roleRef"]["kind"], b["roleRef"]["name"]) for b in _by_kind(docs, "RoleBinding")
    }
    assert bindings == {
        ("ml", "Role", "tidal-operator"),
        ("research", "Role", "tidal-operator"),
        ("tidal-system", "Role", "tidal-operator-leader-election"),
    }
    for binding in _by_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "tidal-operator", "namespace": "tidal-system"}
        ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "watchNamespaces={ml}"), "rbac.scope=cluster grants every namespace"),
        (("--set", "rbac.scope=namespaces"), "rbac.scope=namespaces needs watchNamespaces"),
        # The check does not depend on the chart creating the RBAC: the operator's flags follow the scope.
        (("--set", "rbac.create=false", "--set", "watchNamespaces={ml}"), "rbac.scope=cluster grants every namespace"),
        (("--set", "rbac.scope=tenant"), "/rbac/scope"),
    ],
)
def test_a_scope_that_disagrees_with_the_namespaces_is_refused(args: tuple[str, ...], message: str):
    result = subprocess.run([HELM, "template", "tidal", str(CHART), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_no_policy_unless_asked():
    docs = _template()
    assert not _by_kind(docs, "ValidatingAdmissionPolicy") and not _by_kind(docs, "ValidatingAdmissionPolicyBinding")


@functools.cache
def _policy() -> dict:
    docs = _template(*RESTRICT)
    (policy,) = _by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = _by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    return policy


def test_policy_matches_inference_model_writes():
    spec = _policy()["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["tidal.dev"] and rule["resources"] == ["inferencemodels"]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    # The path the policy reads is the CRD's free-form pod template.
    worker = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "worker"
    ]
    template_spec = worker["properties"]["podTemplate"]["properties"]["spec"]
    assert template_spec["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["variables"][0]["name"] == "podSpec"
    assert "object.spec.worker.podTemplate.spec" in spec["variables"][0]["expression"]


def _refusals(policy: dict, model_spec: dict[str, Any]) -> list[str]:
    """The messages of the validations that fail, evaluated as the API server does: variables in order, then each
    validation with `object` and `variables` bound."""
    env = celpy.Environment()
    activation: dict[str, Any] = {"object": celpy.json_to_cel({"spec": model_spec})}
    variables: dict[celpy.celtypes.StringType, Any] = {}
    for var in policy["spec"]["variables"]:
        activation["variables"] = celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(var["name"])] = env.program(env.compile(var["expression"])).evaluate(
            activation
        )
    activation["variables"] = celpy.celtypes.MapType(variables)
    return [
        v["message"]
        for v in policy["spec"]["validations"]
        if not env.program(env.compile(v["expression"])).evaluate(activation)
    ]


def _with_template(spec: dict[str, Any]) -> dict[str, Any]:
    return {"worker": {"podTemplate": {"spec": spec}}}


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"hostNetwork": True}, "spec.worker.podTemplate.spec.hostNetwork:"),
        ({"hostPID": True}, "spec.worker.podTemplate.spec.hostPID:"),
        ({"hostIPC": True}, "spec.worker.podTemplate.spec.hostIPC:"),
        ({"containers": [{"name": "worker", "securityContext": {"privileged": True}}]}, "securityContext.privileged"),
        (
            {"initContainers": [{"name": "setup", "securityContext": {"privileged": True}}]},
            "securityContext.privileged",
        ),
        ({"serviceAccountName": "builder"}, "spec.worker.podTemplate.spec.serviceAccountName:"),
        ({"serviceAccount": "builder"}, "spec.worker.podTemplate.spec.serviceAccountName:"),
        ({"automountServiceAccountToken": True}, "automountServiceAccountToken"),
        # null removes Tidal's `false`, and the default is to mount the token.
        ({"automountServiceAccountToken": None}, "automountServiceAccountToken"),
    ],
)
def test_policy_refuses_each_escape_with_a_message_naming_the_field(template: dict[str, Any], field: str):
    (message,) = _refusals(_policy(), _with_template(template))
    assert field in message and "podTemplatePolicy" in message


@pytest.mark.parametrize(
    "model_spec",
    [
        {},
        {"worker": {}},
        {"worker": {"podTemplate": {"metadata": {"labels": {"team": "ml"}}}}},
        _with_template({"hostNetwork": False, "hostPID": None, "automountServiceAccountToken": False}),
        _with_template(
            {
                "containers": [{"name": "worker", "securityContext": {"privileged": False}}, {"name": "sidecar"}],
                "priorityClassName": "inference",
                "volumes": [{"name": "cache", "emptyDir": {}}],
            }
        ),
    ],
)
def test_policy_lets_ordinary_templates_through(model_spec: dict[str, Any]):
    assert _refusals(_policy(), model_spec) == []
