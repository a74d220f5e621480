"""The chart's monitoring against the real things: its ServiceMonitor, PodMonitor, PrometheusRule and dashboard
ConfigMap applied against the Prometheus Operator's own CRDs, and a real Prometheus (built by
hack/install-monitoring.sh) scraping the devcluster's operator and a worker the way those monitors describe, loading
the alerts, and answering every query of the dashboard."""

import copy
import json
import math
import os
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from monitoring_e2e import Prometheus, scrape_configs
from operator_e2e import (
    CHART,
    OPERATOR_NS,
    RELEASE,
    complete,
    create_model,
    install_operator,
    model_manifest,
    model_pods,
    patch_spec,
    phase_is,
    wait_model,
    wait_until,
)

from tidal.devcluster.testing import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MONITORING_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
VALUES = (
    *(f"monitoring.{p}.enabled=true" for p in ("serviceMonitor", "podMonitor", "prometheusRule", "dashboard")),
    # Scrape every second so a short run has several samples.
    "monitoring.serviceMonitor.interval=1s",
    "monitoring.podMonitor.interval=1s",
)
# Quantiles of what the test does (requests, a sleep and a wake): finite numbers, not NaN, once they are scraped.
MUST_BE_FINITE = (
    "Time to first token", "Inter-token latency", "End-to-end request latency", "Sleep and wake of all ranks (p90)",
)  # fmt: skip


def _tool(name: str, env_dir: str) -> str:
    path = Path(os.environ.get(env_dir, "/nonexistent")) / name
    if not path.is_file():
        pytest.fail(f"{name} is missing: run `make monitoring-tools` (hack/install-monitoring.sh)", pytrace=False)
    return str(path)


@pytest.fixture(scope="module")
def rendered(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The Prometheus Operator's CRDs installed, then the chart's monitoring objects applied through the API server."""
    install_operator(devcluster)
    crds = Path(os.environ.get("TIDAL_PROMETHEUS_OPERATOR_CRDS", "/nonexistent"))
    if not (crds / "monitoring.coreos.com_podmonitors.yaml").is_file():
        pytest.fail("Prometheus Operator CRDs missing: run `make monitoring-tools`", pytrace=False)
    devcluster.kubectl("apply", "--server-side", "-f", str(crds))
    # Polled: `kubectl wait` errors out on a CRD whose status has no conditions yet.
    extensions = client.ApiextensionsV1Api(devcluster.api_client)

    def established(name: str) -> bool:
        conditions = extensions.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    for kind in ("servicemonitors", "podmonitors", "prometheusrules"):
        crd = f"{kind}.monitoring.coreos.com"
        wait_until(lambda crd=crd: established(crd), 60, f"{crd} established")
    out = devcluster.helm(
        "template", RELEASE, str(CHART), "--namespace", OPERATOR_NS, *(a for v in VALUES for a in ("--set", v))
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    objects = [d for d in docs if d["kind"] in MONITORING_KINDS or "tidal.json" in (d.get("data") or {})]
    manifest = tmp_path_factory.mktemp("monitoring") / "objects.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    devcluster.kubectl("apply", "--server-side", "-f", str(manifest))
    return objects


def test_monitoring_objects_are_accepted_by_their_real_crds(devcluster, rendered, tmp_path):
    assert sorted(o["kind"] for o in rendered) == ["ConfigMap", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for obj in rendered:
        name = f"{obj['kind'].lower()}/{obj['metadata']['name']}"
        devcluster.kubectl("get", "-n", obj["metadata"]["namespace"], name)
    # The schema is really enforced: a malformed scrape interval is refused.
    (pod_monitor,) = [copy.deepcopy(o) for o in rendered if o["kind"] == "PodMonitor"]
    pod_monitor["metadata"]["name"] = "malformed"
    pod_monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "every second"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(pod_monitor))
    refused = devcluster.kubectl("apply", "--server-side", "-f", str(tmp_path / "bad.yaml"), check=False)
    assert refused.returncode != 0 and "podMetricsEndpoints[0].interval" in refused.stderr, refused.stderr


def _wait_targets_up(prom: Prometheus, namespace: str, model: str) -> None:
    def up() -> bool:
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        healthy = [t["labels"] for t in active if t["health"] == "up"]
        operator = any(t["namespace"] == OPERATOR_NS and t["job"].endswith("-metrics") for t in healthy)
        worker = any(t["namespace"] == namespace and t.get("model") == model for t in healthy)
        return operator and worker

    try:
        wait_until(up, 60, "the operator and the worker scraped by Prometheus")
    except TimeoutError as exc:
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        seen = [(t["labels"], t["health"], t["lastError"]) for t in active]
        raise AssertionError(f"{exc}; targets: {seen}\n{prom.log_path.read_text()}") from None


def test_prometheus_scrapes_operator_and_worker_and_the_dashboard_has_data(
    devcluster, namespace, models, rendered, tmp_path
):
    name = "watched"
    create_model(devcluster, namespace, model_manifest(name, models))
    wait_model(devcluster, namespace, name, phase_is("Ready"), timeout_s=150, what="Ready")
    (pod,) = model_pods(devcluster, namespace, name)

    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    (rule,) = [o for o in rendered if o["kind"] == "PrometheusRule"]
    (workdir / "alerts.yaml").write_text(yaml.safe_dump(rule["spec"]))
    monitors = [o for o in rendered if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    services = json.loads(devcluster.kubectl("get", "services", "-A", "-o", "json").stdout)["items"]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(workdir / "alerts.yaml")],
        "scrape_configs": scrape_configs(monitors, services, devcluster.kubeconfig),
    }
    prom = Prometheus(_tool("prometheus", "TIDAL_PROMETHEUS_BIN"), workdir, config)
    try:
        prom.wait_ready()
        _wait_targets_up(prom, namespace, name)
        # A sleep and a wake, for the operator's transition timings.
        patch_spec(devcluster, namespace, name, {"sleep": {"state": "Asleep"}})
        wait_model(devcluster, namespace, name, phase_is("Sleeping"), timeout_s=60, what="Sleeping")
        patch_spec(devcluster, namespace, name, {"sleep": {"state": "Awake"}})
        wait_model(devcluster, namespace, name, phase_is("Ready"), timeout_s=60, what="Ready again")
        for prompt in ("The tide", "Moon and sea", "Twice a day"):
            complete(devcluster, namespace, pod, prompt, max_tokens=8)
        selector = f'namespace="{namespace}", model="{name}"'
        wait_until(
            lambda: prom.query(f'sum(tidal_requests_total{{{selector}, outcome="length"}}) >= 3'), 30,
            "the requests scraped",
        )  # fmt: skip
        wait_until(lambda: prom.query(f'tidal_operator_model_phase{{{selector}, phase="Ready"}} == 1'), 30, "phase")
        wait_until(
            lambda: prom.query('sum(tidal_operator_sleep_wake_duration_seconds_count) >= 2'), 30, "the sleep and wake"
        )  # fmt: skip

        dashboard = yaml.safe_load(next(o for o in rendered if o["kind"] == "ConfigMap")["data"]["tidal.json"])
        values = {"$__rate_interval": "1m", "$namespace": namespace, "$model": name}
        empty, checked = [], 0
        for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in values.items():
                    expr = expr.replace(variable, value)
                result = prom.query(expr)  # fails on any evaluation error
                checked += 1
                if not result:
                    empty.append(panel["title"])
                elif panel["title"] in MUST_BE_FINITE:
                    assert all(math.isfinite(float(s["value"][1])) for s in result), (panel["title"], result)
        assert checked >= 30
        assert not empty, f"queries without data: {sorted(set(empty))}"

        # The alerts load into the running Prometheus and evaluate without error.
        def evaluated() -> list[dict]:
            rules = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
            return rules if all(r.get("lastEvaluation", "").startswith("20") for r in rules) else []

        rules = wait_until(evaluated, 20, "every alert evaluated")
        assert len(rules) == 6 and {r["health"] for r in rules} == {"ok"}, rules
        firing = [r["name"] for r in rules if r["state"] == "firing"]
        assert not firing, firing
    finally:
        prom.close()
