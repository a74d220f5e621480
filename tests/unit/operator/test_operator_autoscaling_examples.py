"""The autoscaling examples stay true to what they point at: the InferenceModel of examples/tiny-model.yaml, the
worker pods' port and labels, and a metric the worker really exports."""

from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from tidal.operator.api import constants as c
from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders.pod import build_pod
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.testing.engine_stats import idle_engine_stats

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
AUTOSCALING = EXAMPLES / "autoscaling"
TINY = InferenceModel.model_validate(yaml.safe_load((EXAMPLES / "tiny-model.yaml").read_text()))
WAITING = "tidal_requests_waiting"


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((AUTOSCALING / name).read_text())


def _worker_metric_names() -> set[str]:
    metrics = WorkerMetrics(CollectorRegistry(), idle_engine_stats)
    return {family.name for family in metrics.registry.collect()}


def _prometheus_label(kubernetes_label: str) -> str:
    """How the Prometheus Operator names a pod label it copies onto series (podTargetLabels)."""
    return "".join(ch if ch.isalnum() else "_" for ch in kubernetes_label)


def test_every_file_is_covered_here():
    assert {p.name for p in AUTOSCALING.glob("*.yaml")} == {
        "hpa-waiting-requests.yaml",
        "keda-waiting-requests.yaml",
        "podmonitor.yaml",
        "prometheus-adapter-values.yaml",
    }


def test_autoscalers_target_the_example_model_through_its_scale():
    target = {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": TINY.metadata.name}
    hpa = _load("hpa-waiting-requests.yaml")
    keda = _load("keda-waiting-requests.yaml")
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert (keda["apiVersion"], keda["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert hpa["spec"]["scaleTargetRef"] == target and keda["spec"]["scaleTargetRef"] == target
    # Within what spec.replicas accepts, so an autoscaler's write is never refused by the CRD's bounds.
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] <= 64
    assert 1 <= keda["spec"]["minReplicaCount"] <= keda["spec"]["maxReplicaCount"] <= 64


def test_metrics_are_ones_the_worker_exports():
    exported = _worker_metric_names()
    assert WAITING in exported
    hpa_metric = _load("hpa-waiting-requests.yaml")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rule = _load("prometheus-adapter-values.yaml")["rules"]["custom"][0]
    assert hpa_metric == rule["name"]["as"] == WAITING
    assert rule["seriesQuery"].startswith(WAITING + "{")
    query = _load("keda-waiting-requests.yaml")["spec"]["triggers"][0]["metadata"]["query"]
    assert f"{WAITING}{{" in query
    assert f'{_prometheus_label(c.LABEL_MODEL)}="{TINY.metadata.name}"' in query


def test_pod_monitor_scrapes_the_worker_pods_on_their_serving_port():
    monitor = _load("podmonitor.yaml")["spec"]
    pod = build_pod(TINY, 0, 0)
    labels = pod["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    assert set(monitor["podTargetLabels"]) <= set(labels)
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["serve"] and "serve" in ports
