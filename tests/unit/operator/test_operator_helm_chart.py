"""The Helm chart: lint-clean, renders, least-privilege RBAC, and agrees with the CRD and the operator's config."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tidal.operator.config import OperatorConfig
from tidal.operator.schema.crd import build_crd

CHART = Path(__file__).resolve().parents[3] / "charts" / "tidal"


def _helm() -> str | None:
    found = shutil.which("helm")
    if found:
        return found
    candidate = Path(os.environ.get("TIDAL_BIN", "/nonexistent")) / "helm"
    return str(candidate) if candidate.is_file() else None


HELM = _helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built (hack/build-binaries.sh); CI has it")


def _template(*args: str) -> list[dict]:
    out = subprocess.run(
        [HELM, "template", "tidal", str(CHART), "--namespace", "tidal-system", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_is_clean():
    result = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def test_chart_ships_the_generated_crd():
    docs = _template("--include-crds")
    (crd,) = _by_kind(docs, "CustomResourceDefinition")
    assert crd == build_crd()


def test_rbac_is_least_privilege():
    docs = _template()
    rules = [rule for role in _by_kind(docs, "ClusterRole") + _by_kind(docs, "Role") for rule in role["rules"]]
    granted = {}
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    assert set(granted) == {
        "customresourcedefinitions",
        "inferencemodels",
        "inferencemodels/status",
        "inferencemodels/finalizers",
        "pods",
        "services",
        "secrets",
        "networkpolicies",
        "events",
        "leases",
    }
    # Secrets are read by name (never listed) and patched only to repair a token Secret that holds no token.
    assert granted["secrets"] == {"get", "create", "patch"}
    # Exactly what the operator calls (kube/client.py) and kopf's watches: pods are patched for their serving label
    # only, Services and NetworkPolicies are read by name (never listed), Events only created (kopf's posting is off).
    assert granted["pods"] == {"get", "list", "watch", "create", "delete", "patch"}
    assert granted["services"] == {"get", "create", "patch"}
    assert granted["networkpolicies"] == {"get", "create", "patch"}
    assert granted["events"] == {"create"}
    # Children carry ownerReferences with blockOwnerDeletion: true. Where the OwnerReferencesPermissionEnforcement
    # admission plugin runs (OpenShift, hardened clusters), setting that needs update on the owner's finalizers.
    assert granted["inferencemodels/finalizers"] == {"update"}
    assert granted["customresourcedefinitions"] == {"get", "list", "watch"}
    for binding in _by_kind(docs, "ClusterRoleBinding") + _by_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["name"] not in ("cluster-admin", "admin", "edit")


def test_deployment_runs_the_operator_with_a_valid_config():
    docs = _template()
    (deploy,) = _by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "tidal.operator"]
    # Variables from the downward API (namespace, pod name, pod IP) are filled in at run time.
    from_pod = {e["name"] for e in container["env"] if "valueFrom" in e}
    assert {"TIDAL_OPERATOR_NAMESPACE", "TIDAL_OPERATOR_POD_NAME", "TIDAL_OPERATOR_BIND_ADDRESS"} <= from_pod
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["TIDAL_OPERATOR_NAMESPACE"] = "tidal-system"
    config = OperatorConfig.from_env(env)
    # Worker NetworkPolicies admit pods with these labels: they must be the operator pod's own.
    assert config.pod_labels.items() <= pod["metadata"]["labels"].items()
    # Leader election (a Lease) keeps replicas from fighting, so rolling updates and several replicas are safe.
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate" and deploy["spec"]["replicas"] == 1
    assert config.lease_name == "tidal-operator"
    (service,) = _by_kind(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_values_schema_rejects_bad_values():
    result = subprocess.run(
        [HELM, "template", "tidal", str(CHART), "--set", "logLevel=loud"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "logLevel" in result.stderr
