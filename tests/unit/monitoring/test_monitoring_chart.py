"""The chart's monitoring objects: off by default, each behind its own switch, selecting what the operator and its
workers really expose, and the dashboard ConfigMap carrying the file as Grafana's sidecar expects."""

import json
import subprocess

import pytest
from monitoring_assets import ALL_ON, CHART, DASHBOARD, helm_template, tool

from tidal.operator.api import constants as c
from tidal.operator.builders import names

HELM = tool("helm", "TIDAL_BIN")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built (hack/build-binaries.sh); CI has it")
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _template(*sets: str) -> list[dict]:
    assert HELM is not None
    return helm_template(HELM, *sets)


def _one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def _dashboards(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "tidal.json" in d.get("data", {})]


def test_helm_lint_is_clean_with_everything_on():
    assert HELM is not None
    args = [arg for s in ALL_ON for arg in ("--set", s)]
    result = subprocess.run([HELM, "lint", "--strict", str(CHART), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def test_everything_is_off_by_default():
    docs = _template()
    assert not [d for d in docs if d["kind"] in MONITORING_KINDS] and not _dashboards(docs)


@pytest.mark.parametrize("part", ["serviceMonitor", "podMonitor", "prometheusRule", "dashboard"])
def test_each_part_has_its_own_switch(part):
    docs = _template(f"monitoring.{part}.enabled=true")
    kinds = {d["kind"] for d in docs if d["kind"] in MONITORING_KINDS} | ({"dashboard"} if _dashboards(docs) else set())
    expected = {"serviceMonitor": "ServiceMonitor", "podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule"}
    assert kinds == {expected.get(part, part)}


def test_service_monitor_scrapes_the_operator_metrics_service():
    docs = _template(*ALL_ON, "monitoring.serviceMonitor.labels.release=kps")
    monitor, service = _one(docs, "ServiceMonitor"), _one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True


def test_service_monitor_needs_the_metrics_service():
    assert HELM is not None
    with pytest.raises(subprocess.CalledProcessError) as failed:
        helm_template(HELM, "monitoring.serviceMonitor.enabled=true", "metrics.service.enabled=false")
    assert "needs metrics.service.enabled" in failed.value.stderr


def test_pod_monitor_selects_every_worker_pod_on_its_serving_port():
    monitor = _one(_template(*ALL_ON), "PodMonitor")
    for leader in (True, False):
        labels = names.pod_labels("m", replica=1, rank=0 if leader else 1, leader=leader, serving=leader)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("serve", "/metrics")
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    label = {"model": c.LABEL_MODEL, "replica": c.LABEL_REPLICA, "rank": c.LABEL_RANK}
    for target, pod_label in label.items():
        meta = "__meta_kubernetes_pod_label_" + "".join(ch if ch.isalnum() else "_" for ch in pod_label)
        assert targets[target] == [meta]


def test_pod_monitor_follows_the_watched_namespaces():
    monitor = _one(_template(*ALL_ON, "rbac.scope=namespaces", "watchNamespaces={team-a,team-b}"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_dashboard_configmap_carries_the_file_with_the_sidecar_label():
    (default,) = _dashboards(_template("monitoring.dashboard.enabled=true"))
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert default["metadata"]["namespace"] == "tidal-system"
    assert json.loads(default["data"]["tidal.json"]) == json.loads(DASHBOARD.read_text())
    (moved,) = _dashboards(
        _template(
            "monitoring.dashboard.enabled=true",
            "monitoring.dashboard.namespace=grafana",
            "monitoring.dashboard.labels.grafana_dashboard=tidal",
            "monitoring.dashboard.annotations.grafana_folder=LLM",
        )
    )
    assert moved["metadata"]["namespace"] == "grafana"
    assert moved["metadata"]["labels"]["grafana_dashboard"] == "tidal"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_dashboard_has_the_panels_a_model_needs():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for needed in (
        "Time to first token", "Inter-token latency", "End-to-end request latency", "Requests by outcome", "Tokens",
        "Running and waiting requests", "KV-cache usage by rank", "Sleep level by rank (0: awake)",
        "Weights version by rank", "Process restarts in the last hour", "Expert-parallel group epoch and size",
    ):  # fmt: skip
        assert needed in titles
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "namespace", "model"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
