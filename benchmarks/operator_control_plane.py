"""Operator control-plane timings on the local control plane (tidal.devcluster), with the chart installed.

What it measures (each printed with its definition):
1. apply -> all pods created: create an InferenceModel with `--replicas` replicas of the tiny example model and time
   until every rank's pod exists in the API (the operator saw the object, planned and created the pods), then until
   the model's phase is Ready (pods scheduled, worker processes started, torch and the model loaded, probes passed).
2. pod failure -> Degraded: a model whose worker exits at once (its model directory is missing). From the first
   container exit the API shows, to the node agent's CrashLoopBackOff, to `Degraded=True` in the model's status.
3. reconcile throughput: `--models` InferenceModels created back to back whose pods can never be scheduled (a
   nodeSelector no node has), so no worker process runs and only the operator's own work is timed: until every
   model has its pod and a status for its generation; plus the reconciles the operator counted in that window
   (from its /metrics) and their mean duration.

    source hack/env.sh && python benchmarks/operator_control_plane.py [--models 50] [--replicas 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from kubernetes import watch

from tidal.devcluster.testing import DevCluster, cluster_with_chart
from tidal.operator.api import constants as c

REPO = Path(__file__).resolve().parents[1]
NS = "default"


def manifest(name: str, models: Path, **spec: Any) -> dict[str, Any]:
    body = {
        "model": {"volume": {"hostPath": {"path": str(models)}}, "path": "tiny-llama", "dtype": "float32",
                  "maxModelLen": 512},
        "worker": {"resources": {"cpu": "100m", "memory": "256Mi"}},
    }  # fmt: skip
    for key, value in spec.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name}, "spec": body}


def create(dc: DevCluster, obj: dict[str, Any]) -> None:
    dc.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, NS, c.PLURAL, obj)


def watch_until(list_fn: Any, *args: Any, check: Any, timeout_s: float = 300, **kwargs: Any) -> float:
    """Watch a list until check(objects by name) holds; returns time.monotonic() at that moment."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = watch.Watch()
        for event in w.stream(list_fn, *args, timeout_seconds=max(1, int(deadline - time.monotonic())), **kwargs):
            obj = event["object"]
            obj = obj if isinstance(obj, dict) else obj.to_dict()
            name = obj["metadata"]["name"]
            if event["type"] == "DELETED":
                seen.pop(name, None)
            else:
                seen[name] = obj
            if check(seen):
                w.stop()
                return time.monotonic()
    raise TimeoutError(f"not reached in {timeout_s} s")


def operator_metrics(dc: DevCluster) -> dict[str, float]:
    pods = dc.core.list_namespaced_pod("tidal-system", label_selector="app.kubernetes.io/name=tidal-operator").items
    text = httpx.get(f"http://{pods[0].status.pod_ip}:8080/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(tidal_operator_reconcile\w*?)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def reconciles(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("tidal_operator_reconciles_total"))


def bench_apply(dc: DevCluster, models: Path, replicas: int) -> None:
    start = time.monotonic()
    create(dc, manifest("bench-apply", models, replicas=replicas))
    pods = watch_until(
        dc.core.list_namespaced_pod, NS, label_selector=f"{c.LABEL_MODEL}=bench-apply",
        check=lambda seen: len(seen) == replicas,
    )  # fmt: skip
    ready = watch_until(
        dc.custom.list_namespaced_custom_object, c.GROUP, c.VERSION, NS, c.PLURAL,
        field_selector="metadata.name=bench-apply",
        check=lambda seen: (seen.get("bench-apply", {}).get("status") or {}).get("phase") == "Ready",
    )  # fmt: skip
    print(f"apply -> all {replicas} pods created:       {pods - start:6.2f} s")
    print(f"apply -> phase Ready ({replicas} tiny workers):  {ready - start:6.2f} s")
    dc.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, NS, c.PLURAL, "bench-apply")


def bench_degraded(dc: DevCluster, models: Path) -> None:
    """The pod and the model are watched at the same time (two threads), so each moment is when it was first seen."""
    pod = "bench-crash-r0-0"
    seen: dict[str, float] = {}

    def pod_events(pods: dict) -> bool:
        for cs in ((pods.get(pod) or {}).get("status") or {}).get("container_statuses") or []:
            state, last = cs.get("state") or {}, cs.get("last_state") or {}
            if state.get("terminated") or last.get("terminated"):
                seen.setdefault("exit", time.monotonic())
            if (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                seen.setdefault("backoff", time.monotonic())
        return "exit" in seen and "backoff" in seen

    def degraded(objs: dict) -> bool:
        conds = (objs.get("bench-crash", {}).get("status") or {}).get("conditions") or []
        return any(x["type"] == "Degraded" and x["status"] == "True" for x in conds)

    def watch_model() -> None:
        seen["degraded"] = watch_until(
            dc.custom.list_namespaced_custom_object, c.GROUP, c.VERSION, NS, c.PLURAL,
            field_selector="metadata.name=bench-crash", check=degraded,
        )  # fmt: skip

    model_thread = threading.Thread(target=watch_model)
    model_thread.start()
    create(dc, manifest("bench-crash", models, model={"path": "no-such-model"}))
    watch_until(dc.core.list_namespaced_pod, NS, check=pod_events, field_selector=f"metadata.name={pod}")
    model_thread.join()
    print(f"first container exit -> CrashLoopBackOff:     {seen['backoff'] - seen['exit']:6.2f} s  (node agent)")
    print(f"CrashLoopBackOff -> Degraded=True in status:  {seen['degraded'] - seen['backoff']:6.2f} s  (operator)")
    print(f"first container exit -> Degraded=True:        {seen['degraded'] - seen['exit']:6.2f} s")
    dc.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, NS, c.PLURAL, "bench-crash")


def bench_throughput(dc: DevCluster, models: Path, count: int) -> None:
    before = operator_metrics(dc)
    start = time.monotonic()
    for i in range(count):
        create(dc, manifest(f"bench-{i:03d}", models, worker={"nodeSelector": {"tidal.dev/bench": "nowhere"}}))
    created = time.monotonic()
    pods = watch_until(
        dc.core.list_namespaced_pod, NS, label_selector=c.LABEL_MODEL,
        check=lambda seen: sum(1 for n in seen if n.startswith("bench-0")) >= count,
    )  # fmt: skip

    def current(obj: dict) -> bool:
        status = obj.get("status") or {}
        return status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("totalRanks") == 1

    def all_status(seen: dict) -> bool:
        return sum(1 for n, o in seen.items() if n.startswith("bench-0") and current(o)) >= count

    statuses = watch_until(dc.custom.list_namespaced_custom_object, c.GROUP, c.VERSION, NS, c.PLURAL, check=all_status)
    after = operator_metrics(dc)
    n = reconciles(after) - reconciles(before)
    dur_sum = (
        after["tidal_operator_reconcile_duration_seconds_sum"] - before["tidal_operator_reconcile_duration_seconds_sum"]
    )
    dur_n = (
        after["tidal_operator_reconcile_duration_seconds_count"]
        - before["tidal_operator_reconcile_duration_seconds_count"]
    )
    elapsed = statuses - start
    print(f"{count} models created by the client in:        {created - start:6.2f} s")
    print(f"{count} models -> all {count} pods created:          {pods - start:6.2f} s")
    print(f"{count} models -> all statuses written:        {elapsed:6.2f} s  ({count / elapsed:.1f} models/s)")
    print(f"reconciles counted by the operator meanwhile: {n:6.0f}    ({n / elapsed:.1f}/s, mean "
          f"{1000 * dur_sum / max(dur_n, 1):.0f} ms each)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as tmp:
        root = Path(tmp)
        models = root / "models"
        subprocess.run(
            [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "llama", "--out",
             str(models / "tiny-llama")], check=True, capture_output=True,
        )  # fmt: skip
        with cluster_with_chart(root / "cluster", REPO / "charts" / "tidal", cpu="64", memory="256Gi") as dc:
            print(f"local control plane up; operator installed by the chart ({time.strftime('%H:%M:%S')})\n")
            bench_apply(dc, models, args.replicas)
            bench_degraded(dc, models)
            bench_throughput(dc, models, args.models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
