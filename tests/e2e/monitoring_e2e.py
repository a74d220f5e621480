"""A real Prometheus for the monitoring e2e test: a scrape configuration derived from the chart's ServiceMonitor
and PodMonitor as the Prometheus Operator would derive it (Kubernetes service discovery against the devcluster's API
server, the same keep rules and target labels, for the fields the chart uses), and the process itself."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def _meta(prefix: str, label: str) -> str:
    return f"__meta_kubernetes_{prefix}_{re.sub(r'[^a-zA-Z0-9_]', '_', label)}"


def _keep_labels(prefix: str, match_labels: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"action": "keep", "source_labels": [_meta(f"{prefix}_label", k), _meta(f"{prefix}_labelpresent", k)],
         "regex": f"({re.escape(v)});true"}
        for k, v in match_labels.items()
    ]  # fmt: skip


def _namespaces(obj: dict[str, Any]) -> dict[str, Any]:
    selector = obj["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return {}
    return {"namespaces": {"names": selector.get("matchNames") or [obj["metadata"]["namespace"]]}}


def _user_relabelings(endpoint: dict[str, Any]) -> list[dict[str, Any]]:
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex", "action": "action",
            "replacement": "replacement", "separator": "separator"}  # fmt: skip
    return [{keys[k]: v for k, v in r.items()} for r in endpoint.get("relabelings", [])]


def _job(kind: str, obj: dict[str, Any], endpoint: dict[str, Any], kubeconfig: Path, rules: list[dict[str, Any]]):
    meta = obj["metadata"]
    return {
        "job_name": f"{kind}/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "scrape_interval": endpoint.get("interval", "30s"),
        "metrics_path": endpoint.get("path", "/metrics"),
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig), **_namespaces(obj)}],
        "relabel_configs": rules + _user_relabelings(endpoint),
    }  # fmt: skip


def _service_pods(service: dict[str, Any], port_name: str) -> list[dict[str, Any]]:
    """Keep rules for the pods behind `service`'s port `port_name`, as the EndpointSlice controller picks them:
    ready pods its selector matches, at the container port its targetPort names (or numbers)."""
    (port,) = [p for p in service["spec"]["ports"] if p.get("name") == port_name]
    target = port.get("targetPort", port["port"])
    by_port = "name" if isinstance(target, str) else "number"
    return [
        *_keep_labels("pod", service["spec"]["selector"]),
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_ready"], "regex": "true"},
        {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_container_port_{by_port}"], "regex": str(target)},
    ]


def scrape_configs(
    monitors: list[dict[str, Any]], services: list[dict[str, Any]], kubeconfig: Path
) -> list[dict[str, Any]]:
    """One job per endpoint of each PodMonitor, and per endpoint and selected Service of each ServiceMonitor.

    A ServiceMonitor's targets are normally its Services' endpoints. The devcluster has none to discover (its pods'
    loopback addresses are refused in EndpointSlices; see tidal.devcluster.service_endpoints), so the Services it
    selects are resolved here and their pods discovered directly, with the rule the EndpointSlice controller applies.
    """
    jobs = []
    for obj in monitors:
        spec = obj["spec"]
        common = [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                  {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]  # fmt: skip
        if obj["kind"] == "PodMonitor":
            (endpoint,) = spec["podMetricsEndpoints"]
            rules = [
                *_keep_labels("pod", spec["selector"]["matchLabels"]),
                {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                 "regex": endpoint["port"]},
                *common,
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"target_label": "job", "replacement": f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"},
            ]  # fmt: skip
            jobs.append(_job("podMonitor", obj, endpoint, kubeconfig, rules))
            continue
        (endpoint,) = spec["endpoints"]
        names = _namespaces(obj).get("namespaces", {}).get("names")
        selected = [
            svc for svc in services
            if (names is None or svc["metadata"]["namespace"] in names)
            and spec["selector"]["matchLabels"].items() <= (svc["metadata"].get("labels") or {}).items()
        ]  # fmt: skip
        assert selected, f"ServiceMonitor {obj['metadata']['name']} selects no Service"
        for svc in selected:
            rules = [
                *_service_pods(svc, endpoint["port"]),
                *common,
                {"target_label": "service", "replacement": svc["metadata"]["name"]},
                {"target_label": "endpoint", "replacement": endpoint["port"]},
                {"target_label": "job", "replacement": svc["metadata"]["name"]},
            ]
            job = _job("serviceMonitor", obj, endpoint, kubeconfig, rules)
            job["job_name"] += f"/{svc['metadata']['name']}"
            job["kubernetes_sd_configs"][0]["namespaces"] = {"names": [svc["metadata"]["namespace"]]}
            jobs.append(job)
    return jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`prometheus` on a loopback port with its own storage, stopped by `close`."""

    def __init__(self, binary: str, workdir: Path, config: dict[str, Any]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = (workdir / "prometheus.log").open("w")
        self._proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.log_path = workdir / "prometheus.log"

    def get(self, path: str, **params: str) -> Any:
        resp = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = resp.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._proc.poll() is None, f"prometheus exited:\n{self.log_path.read_text()}"
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready in {timeout_s} s:\n{self.log_path.read_text()}")

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
