"""The real control-plane parts: garbage collection, CRD validation and printer columns, RBAC for pod identities,
kubectl and helm."""

import json
import sys
import uuid
from pathlib import Path

import pytest
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from tidal.devcluster.testing import phase_is

pytestmark = pytest.mark.e2e

CHARTS = Path(__file__).parent / "charts"


def test_kubectl_and_helm_report_their_versions(devcluster):
    kubectl = devcluster.kubectl("version", "-o", "json").stdout
    assert '"serverVersion"' in kubectl and '"gitVersion"' in kubectl
    assert devcluster.helm("version", "--short").stdout.startswith("v3.")


def test_node_advertises_cpu_memory_and_gpus(devcluster):
    node = devcluster.core.read_node(devcluster.info.node_name)
    assert node.status.capacity["nvidia.com/gpu"] == str(devcluster.info.gpus)
    assert {"cpu", "memory", "pods"} <= set(node.status.allocatable)
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)


def test_owned_object_is_garbage_collected_with_its_owner(devcluster, namespace):
    core = devcluster.core
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [ref]}})

    core.delete_namespaced_config_map("owner", namespace)
    devcluster.wait_deleted(core.list_namespaced_config_map, namespace, "child", timeout_s=30)


def _widget_crd(group: str) -> dict:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {
                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                    "color": {"type": "string", "enum": ["red", "blue"]},
                },
            }
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "additionalPrinterColumns": [
                        {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                        {"name": "Color", "type": "string", "jsonPath": ".spec.color"},
                    ],
                }
            ],
        },
    }


def test_crd_schema_rejects_invalid_objects_and_printer_columns_show(devcluster, namespace):
    group = f"e2e{uuid.uuid4().hex[:6]}.tidal.dev"
    devcluster.extensions.create_custom_resource_definition(_widget_crd(group))
    try:
        devcluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}", "--timeout=30s")

        def create(name: str, spec: dict) -> dict:
            body = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}
            return devcluster.custom.create_namespaced_custom_object(group, "v1", namespace, "widgets", body)

        with pytest.raises(ApiException) as rejected:
            create("too-big", {"size": 11, "color": "green"})
        assert rejected.value.status == 422
        # The API server's own validation messages, not ours.
        message = json.loads(rejected.value.body)["message"]
        assert "spec.size: Invalid value: 11: spec.size in body should be less than or equal to 10" in message
        assert 'spec.color: Unsupported value: "green"' in message

        create("fine", {"size": 3, "color": "blue"})
        table = devcluster.kubectl("get", f"widgets.{group}", "-n", namespace).stdout.splitlines()
        assert table[0].split() == ["NAME", "SIZE", "COLOR"]  # the CRD's columns replace the default AGE
        assert table[1].split()[:3] == ["fine", "3", "blue"]
    finally:
        devcluster.extensions.delete_custom_resource_definition(f"widgets.{group}")


def test_helm_chart_installs_and_uninstalls(devcluster, namespace):
    devcluster.helm("install", "hi", str(CHARTS / "hello"), "-n", namespace, "--set", "greeting=hej", "--wait")
    cm = devcluster.core.read_namespaced_config_map("hi-greeting", namespace)
    assert cm.data == {"greeting": "hej"}
    assert "hi" in devcluster.helm("list", "-n", namespace, "-q").stdout.split()

    devcluster.helm("uninstall", "hi", "-n", namespace, "--wait")
    with pytest.raises(ApiException) as gone:
        devcluster.core.read_namespaced_config_map("hi-greeting", namespace)
    assert gone.value.status == 404


RBAC_PROBE = """
import json
from kubernetes import client, config
config.load_kube_config()  # from $KUBECONFIG, which the node agent wrote for this pod
core = client.CoreV1Api()
namespace = config.list_kube_config_contexts()[1]["context"]["namespace"]
result = {"configmaps": sorted(cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items)}
try:
    core.list_namespaced_secret(namespace)
    result["secrets"] = "allowed"
except client.exceptions.ApiException as exc:
    result["secrets"] = exc.status
print(json.dumps(result))
"""


def test_pod_calls_the_api_as_its_service_account_under_rbac(devcluster, namespace):
    core, rbac = devcluster.core, devcluster.rbac
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "cm-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader-reads-cms"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "visible"}})
    pod = {
        "metadata": {"name": "rbac"},
        "spec": {
            "serviceAccountName": "reader",
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "not-used", "command": [sys.executable, "-c", RBAC_PROBE]}],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    done = devcluster.wait_pod(namespace, "rbac", phase_is("Succeeded", "Failed"), timeout_s=60)
    output = devcluster.pod_log(namespace, "rbac", "main")
    assert done["status"]["phase"] == "Succeeded", output
    assert '"secrets": 403' in output
    assert '"visible"' in output

    # The same answers from the authorizer, asked as that ServiceAccount.
    sa = f"system:serviceaccount:{namespace}:reader"
    assert (
        devcluster.kubectl("auth", "can-i", "list", "configmaps", "-n", namespace, "--as", sa).stdout.strip() == "yes"
    )
    denied = devcluster.kubectl("auth", "can-i", "list", "secrets", "-n", namespace, "--as", sa, check=False)
    assert denied.stdout.strip() == "no"


KOPF_HANDLERS = """
import kopf

@kopf.on.create("configmaps", labels={"watch": "me"})
def created(name, patch, **_):
    patch.metadata.annotations["e2e.tidal.dev/seen-by"] = "kopf"
"""


def test_kopf_operator_in_a_pod_works_with_its_service_account_only(devcluster, namespace, tmp_path):
    core, rbac = devcluster.core, devcluster.rbac
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "op"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "op"},
            "rules": [
                {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "patch"]},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "op"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "op"},
            "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": namespace}],
        },
    )
    # kopf lists namespaces and CRDs cluster-wide at startup; without that it retries for ~50 s, then degrades.
    cluster_rbac = f"e2e-kopf-{namespace}"
    rbac.create_cluster_role(
        {
            "metadata": {"name": cluster_rbac},
            "rules": [
                {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
                {
                    "apiGroups": ["apiextensions.k8s.io"],
                    "resources": ["customresourcedefinitions"],
                    "verbs": ["list", "watch"],
                },
            ],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": cluster_rbac},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_rbac},
            "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": namespace}],
        }
    )
    try:
        _run_kopf_pod(devcluster, namespace, tmp_path)
    finally:
        rbac.delete_cluster_role_binding(cluster_rbac)
        rbac.delete_cluster_role(cluster_rbac)


def _run_kopf_pod(devcluster, namespace, tmp_path):
    core = devcluster.core
    handlers = tmp_path / "handlers.py"
    handlers.write_text(KOPF_HANDLERS)
    command = [sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace, str(handlers)]
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "op"},
            "spec": {
                "serviceAccountName": "op",
                "containers": [{"name": "main", "image": "not-used", "command": command}],
            },
        },
    )
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "target", "labels": {"watch": "me"}}})

    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_config_map,
        namespace,
        field_selector="metadata.name=target",
        timeout_seconds=60,
        deserialize=False,
    ):
        if event["object"]["metadata"].get("annotations", {}).get("e2e.tidal.dev/seen-by") == "kopf":
            w.stop()
            break
    else:
        pytest.fail(f"kopf never handled the ConfigMap; its log:\n{devcluster.pod_log(namespace, 'op', 'main')}")
