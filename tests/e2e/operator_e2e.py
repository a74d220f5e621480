"""Helpers for the operator's e2e tests: the chart installed once per session, tiny models on a hostPath, waits on
InferenceModels, and direct calls to workers (the test checks what the operator claims).

Fixtures that must be shared by several test modules are memoized here per cluster (a session fixture defined in a
module would run once per importing module).
"""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client, watch

from tidal.devcluster.testing import DevCluster
from tidal.operator.api import constants as c

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tidal"
EXAMPLE = REPO / "examples" / "tiny-model.yaml"
OPERATOR_NS = "tidal-system"
RELEASE = "tidal"
DEPLOYMENT = "tidal-operator"
SEED_A, SEED_B = 0, 7

_installed: dict[int, bool] = {}
_models: dict[int, Path] = {}

ModelPredicate = Callable[[dict[str, Any]], bool]


# -- session-wide setup ----------------------------------------------------------------------------------------
def install_operator(dc: DevCluster) -> None:
    """`helm install` the chart (CRD, RBAC, the operator Deployment), watching all namespaces; once per cluster."""
    if _installed.get(id(dc)):
        return
    dc.helm(
        "install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
        "--set", "resyncSeconds=5", "--set", "leaderElection.leaseSeconds=6", "--wait", "--timeout", "3m",
        timeout=240,
    )  # fmt: skip
    _installed[id(dc)] = True


def write_models(dc: DevCluster, root: Path) -> Path:
    """Version A (`tiny-llama`), version B (`tiny-llama-b`: same architecture, another seed) and a broken checkpoint."""
    if id(dc) in _models:
        return _models[id(dc)]
    root.mkdir(parents=True, exist_ok=True)
    for name, seed in (("tiny-llama", SEED_A), ("tiny-llama-b", SEED_B)):
        subprocess.run(
            [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "llama", "--out", str(root / name),
             "--seed", str(seed)],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    # A safetensors header that promises more bytes than the file has: the worker must refuse it whole.
    header = b'{"model.embed_tokens.weight":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}}'
    (broken / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    _models[id(dc)] = root
    return root


def model_manifest(name: str, models: Path, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/tiny-model.yaml with its hostPath pointed at this session's models, and `spec` merged on top."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name}
    obj["spec"]["model"]["volume"]["hostPath"]["path"] = str(models)
    obj["spec"]["worker"]["resources"] = {"cpu": "500m", "memory": "1Gi"}
    for key, value in (spec or {}).items():
        if isinstance(value, dict) and isinstance(obj["spec"].get(key), dict):
            obj["spec"][key] = {**obj["spec"][key], **copy.deepcopy(value)}
        else:
            obj["spec"][key] = copy.deepcopy(value)
    return obj


# -- the InferenceModel ------------------------------------------------------------------------------------------
def create_model(dc: DevCluster, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    return dc.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, manifest)


def get_model(dc: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    return dc.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name)


def patch_spec(dc: DevCluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    dc.custom.patch_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, name, {"spec": spec})


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((cond for cond in (obj.get("status") or {}).get("conditions", []) if cond["type"] == type_), {})


def phase_is(phase: str) -> ModelPredicate:
    def check(obj: dict[str, Any]) -> bool:
        status = obj.get("status") or {}
        current = status.get("observedGeneration") == obj["metadata"]["generation"]
        return current and status.get("phase") == phase

    return check


def wait_model(
    dc: DevCluster, namespace: str, name: str, predicate: ModelPredicate, timeout_s: float = 120, what: str = ""
) -> dict[str, Any]:
    """Watch the model until predicate holds; fails with the last status seen."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        w = watch.Watch()
        for event in w.stream(
            dc.custom.list_namespaced_custom_object, c.GROUP, c.VERSION, namespace, c.PLURAL,
            field_selector=f"metadata.name={name}", timeout_seconds=max(1, int(deadline - time.monotonic())),
        ):  # fmt: skip
            if event["type"] in ("ADDED", "MODIFIED"):
                last = event["object"]
                if predicate(last):
                    w.stop()
                    return last
    status = yaml.safe_dump((last or {}).get("status"))
    raise TimeoutError(f"{namespace}/{name}: {what or 'condition'} not met in {timeout_s} s; last status:\n{status}")


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met in {timeout_s} s")
        time.sleep(period_s)


def synced_to(version: str) -> ModelPredicate:
    """Ready, WeightsSynced, and every rank serving `version`."""

    def check(obj: dict[str, Any]) -> bool:
        status = obj.get("status") or {}
        synced = condition(obj, "WeightsSynced").get("status") == "True"
        return phase_is("Ready")(obj) and synced and status.get("weightsVersion") == version

    return check


# -- pods and workers ------------------------------------------------------------------------------------------
def model_pods(dc: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    pods = dc.core.list_namespaced_pod(namespace, label_selector=f"{c.LABEL_MODEL}={name}").items
    return {p.metadata.name: p for p in pods}


def pod_identity(dc: DevCluster, namespace: str, name: str) -> dict[str, tuple[str, int]]:
    """pod -> (uid, restarts): what an in-place change must leave as it was."""
    pods = model_pods(dc, namespace, name)
    return {
        n: (p.metadata.uid, sum(s.restart_count for s in p.status.container_statuses or [])) for n, p in pods.items()
    }


def control_token(dc: DevCluster, namespace: str, name: str) -> str:
    secret = dc.core.read_namespaced_secret(f"{name}-control-token", namespace)
    return base64.b64decode(secret.data["token"]).decode()


def worker_state(dc: DevCluster, namespace: str, name: str, pod: str, port: int = 8001) -> dict[str, Any]:
    ip = dc.core.read_namespaced_pod(pod, namespace).status.pod_ip
    headers = {"Authorization": f"Bearer {control_token(dc, namespace, name)}"}
    resp = httpx.get(f"http://{ip}:{port}/state", headers=headers, timeout=10)
    resp.raise_for_status()
    return resp.json()


def worker_checksum(dc: DevCluster, namespace: str, name: str, pod: str, port: int = 8001) -> str:
    ip = dc.core.read_namespaced_pod(pod, namespace).status.pod_ip
    headers = {"Authorization": f"Bearer {control_token(dc, namespace, name)}"}
    resp = httpx.get(f"http://{ip}:{port}/weights/checksum", headers=headers, timeout=60)
    resp.raise_for_status()
    return resp.json()["overall"]


def complete(dc: DevCluster, namespace: str, pod: str, prompt: str | list[int], max_tokens: int = 12) -> str:
    """Greedy completion from one rank's serving port (the devcluster has no Service VIPs)."""
    found = dc.core.read_namespaced_pod(pod, namespace)
    ip, model = found.status.pod_ip, found.metadata.labels[c.LABEL_MODEL]  # the served name defaults to the model's
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"http://{ip}:8000/v1/completions", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def operator_pods(dc: DevCluster) -> list[Any]:
    pods = dc.core.list_namespaced_pod(OPERATOR_NS, label_selector="app.kubernetes.io/name=tidal-operator").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def lease_holder(dc: DevCluster) -> str | None:
    lease = client.CoordinationV1Api(dc.api_client).read_namespaced_lease(DEPLOYMENT, OPERATOR_NS)
    return lease.spec.holder_identity


def events_of(dc: DevCluster, namespace: str, name: str) -> list[Any]:
    events = dc.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e for e in events if e.involved_object.kind == c.KIND]
