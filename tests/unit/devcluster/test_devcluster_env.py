"""Container environment resolution, as the kubelet does it (pure, no cluster)."""

import pytest

from tidal.devcluster.nodeagent.envresolve import (
    EnvContext,
    EnvError,
    container_argv,
    container_env,
    expand,
    parse_quantity,
)
from tidal.devcluster.nodeagent.launch import plan_launch

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "web"}, "annotations": {"a": "b"}},
    "spec": {"nodeName": "devnode", "serviceAccountName": "sa"},
}
SECRETS = {("ns", "creds"): {"token": "s3cret"}}
CONFIG_MAPS = {("ns", "settings"): {"mode": "fast", "level": "3"}}


def ctx() -> EnvContext:
    return EnvContext(
        secret=lambda ns, name: SECRETS.get((ns, name)),
        config_map=lambda ns, name: CONFIG_MAPS.get((ns, name)),
        pod_ip="127.0.9.4",
        host_ip="127.0.0.1",
        node_allocatable={"cpu": "8", "memory": "32Gi"},
    )


def test_expand_follows_kubernetes_rules():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("cost $5", env) == "cost $5"


def test_value_from_sources_and_ordering():
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}, {"secretRef": {"name": "creds"}}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "URL", "value": "http://$(IP):8000/$(NAME)"},
        ],
    }
    env = container_env(POD, container, ctx())
    assert env["CM_mode"] == "fast" and env["token"] == "s3cret"
    assert (env["IP"], env["NAME"], env["NS"], env["APP"], env["SA"]) == ("127.0.9.4", "p", "ns", "web", "sa")
    assert env["MODE"] == "fast" and env["TOKEN"] == "s3cret"
    assert env["URL"] == "http://127.0.9.4:8000/p"


def test_missing_references_hold_the_container_unless_optional():
    missing = {"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}]}
    with pytest.raises(EnvError, match='secret "nope" not found'):
        container_env(POD, missing, ctx())
    missing_key = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "k"}}}],
    }
    with pytest.raises(EnvError, match="couldn't find key k"):
        container_env(POD, missing_key, ctx())
    optional = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}}],
    }
    assert "X" not in container_env(POD, optional, ctx())


def test_resource_field_ref_uses_divisor_and_node_allocatable():
    container = {
        "name": "c",
        "resources": {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m"}},
        "env": [
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
            {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
    }
    env = container_env(POD, container, ctx())
    assert (env["MEM"], env["CPU"], env["CPU_LIMIT"]) == ("1024", "250", "8")
    assert parse_quantity("1.5Gi") == 1.5 * 2**30


def test_argv_needs_a_command_because_there_is_no_image():
    assert container_argv({"args": ["--port", "80"]}, {}) == []
    assert container_argv({"command": ["srv"], "args": ["--bind", "$(IP)"]}, {"IP": "127.0.0.5"}) == [
        "srv",
        "--bind",
        "127.0.0.5",
    ]


def test_launch_plan_adds_identity_gpus_and_drops_the_agents_api_access(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBECONFIG", "/agent/admin.kubeconfig")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    gpu = {"name": "g", "command": ["w"], "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    plan = plan_launch(POD, gpu, ctx(), [1], tmp_path / "kubeconfig", tmp_path, tmp_path / "g.termination-log")
    assert plan.env["KUBECONFIG"] == str(tmp_path / "kubeconfig")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "4" and plan.env["HOSTNAME"] == "p"
    assert plan.cwd == tmp_path and plan.argv == ["w"]
    cpu = {"name": "c", "command": ["w"], "workingDir": "/srv"}
    cpu_only = plan_launch(POD, cpu, ctx(), [1], None, tmp_path, tmp_path / "c.termination-log")
    assert cpu_only.env["CUDA_VISIBLE_DEVICES"] == "" and "KUBECONFIG" not in cpu_only.env
    assert str(cpu_only.cwd) == "/srv"
    with pytest.raises(EnvError, match="runs commands, not images"):
        plan_launch(POD, {"name": "c", "image": "nginx"}, ctx(), [], None, tmp_path, tmp_path / "c.termination-log")
