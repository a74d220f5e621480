"""What end-to-end tests need from a running devcluster: clients, kubectl/helm, pod logs, watch-based waits.

tests/e2e/conftest.py turns this into pytest fixtures; other test suites (the operator's) can use it directly.
"""

import contextlib
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from tidal.devcluster import cluster
from tidal.devcluster.cluster import ClusterInfo
from tidal.devcluster.config import ClusterConfig, resolve_binaries
from tidal.devcluster.nodeagent.faults import inject_local
from tidal.devcluster.nodeagent.layout import container_log

PodPredicate = Callable[[dict[str, Any]], bool]


class DevCluster:
    def __init__(self, info: ClusterInfo, cfg: ClusterConfig) -> None:
        self.info = info
        self.kubeconfig: Path = info.kubeconfig
        self.api_client = config.new_client_from_config(config_file=str(info.kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.extensions = client.ApiextensionsV1Api(self.api_client)
        self._cfg = cfg
        self._bins = resolve_binaries(cfg, ("kubectl",))
        self._helm_home = info.state_dir / "helm-home"

    # -- command-line tools with this cluster's kubeconfig -----------------------------------------------------
    @property
    def kubectl_path(self) -> Path:
        return self._bins["kubectl"]

    def tool_env(self) -> dict[str, str]:
        home = self._helm_home
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            # Helm keeps its repositories and cache per cluster, not in the user's home.
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self._run([str(self._bins["kubectl"]), *args], check, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        helm = resolve_binaries(self._cfg, ("helm",))["helm"]  # RuntimeError with the build hint if missing
        return self._run([str(helm), *args], check, timeout)

    def _run(self, argv: list[str], check: bool, timeout: float) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(argv, env=self.tool_env(), capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    # -- namespaces --------------------------------------------------------------------------------------------
    def create_namespace(self, prefix: str = "e2e", timeout_s: float = 30) -> str:
        stem = re.sub(r"[^a-z0-9-]+", "-", prefix.lower())[:40].strip("-") or "e2e"
        name = f"{stem}-{uuid.uuid4().hex[:6]}"
        # A plain manifest: the client sends a dict as it is, though its annotation names V1Namespace.
        manifest: Any = {"metadata": {"name": name, "labels": {"tidal.dev/e2e": "true"}}}
        self.core.create_namespace(manifest)
        # Pods are refused until the ServiceAccount controller has made the namespace's `default` account.
        w = watch.Watch()
        for _ in w.stream(
            self.core.list_namespaced_service_account,
            name,
            field_selector="metadata.name=default",
            timeout_seconds=int(timeout_s),
        ):
            w.stop()
            return name
        raise TimeoutError(f"namespace {name} got no default ServiceAccount in {timeout_s} s")

    def delete_namespace(self, name: str) -> None:
        self.core.delete_namespace(name)

    # -- pods --------------------------------------------------------------------------------------------------
    def wait_pod(
        self, namespace: str, name: str, predicate: PodPredicate, timeout_s: float = 60, what: str = ""
    ) -> dict[str, Any]:
        """Watch one pod until predicate(pod as a dict) holds; returns that pod, or fails with its last state."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            w = watch.Watch()
            for event in w.stream(
                self.core.list_namespaced_pod,
                namespace,
                field_selector=f"metadata.name={name}",
                timeout_seconds=max(1, int(deadline - time.monotonic())),
                deserialize=False,
            ):
                if event["type"] in ("ADDED", "MODIFIED"):
                    last = event["object"]
                    if predicate(last):
                        w.stop()
                        return last
        raise TimeoutError(f"pod {namespace}/{name}: {what or 'condition'} not met in {timeout_s} s; last: {last}")

    def wait_pod_gone(self, namespace: str, name: str, timeout_s: float = 60) -> None:
        self.wait_deleted(self.core.list_namespaced_pod, namespace, name, timeout_s)

    def wait_deleted(self, list_fn: Callable[..., Any], namespace: str, name: str, timeout_s: float = 60) -> None:
        """Watch (list_fn is e.g. core.list_namespaced_config_map) until the named object no longer exists."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = list_fn(namespace, field_selector=f"metadata.name={name}")
            if not found.items:
                return
            w = watch.Watch()
            for event in w.stream(
                list_fn,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=found.metadata.resource_version,
                timeout_seconds=max(1, int(deadline - time.monotonic())),
                deserialize=False,
            ):
                if event["type"] == "DELETED":
                    w.stop()
                    return
        raise TimeoutError(f"{namespace}/{name} still exists after {timeout_s} s")

    def pod_log(self, namespace: str, name: str, container: str, previous: bool = False) -> str:
        """The container's output of its current run, or of the run before (the node agent writes files)."""
        path = container_log(self.info.pods_dir, namespace, name, container, previous=previous)
        return path.read_text(errors="replace") if path.exists() else ""

    def inject_fault(self, namespace: str, name: str, action: str, container: str | None = None) -> list[int]:
        """crash (SIGKILL), freeze (SIGSTOP) or thaw (SIGCONT) the pod's processes, right now."""
        return inject_local(self.info.pods_dir, namespace, name, action, container)


@contextlib.contextmanager
def cluster_with_chart(state_dir: Path, chart: Path, **config: Any) -> Iterator[DevCluster]:
    """For benchmarks: a devcluster under `state_dir` with Tidal's chart `helm install`ed (release `tidal` in
    `tidal-system`), torn down on exit. `config`: more ClusterConfig fields (e.g. the node's cpu and memory)."""
    cfg = ClusterConfig(state_dir=state_dir, die_with_parent=True, **config)
    info = cluster.up(cfg)
    try:
        dc = DevCluster(info, cfg)
        dc.helm(
            "install", "tidal", str(chart), "-n", "tidal-system", "--create-namespace", "--wait", "--timeout", "3m",
            timeout=240,
        )  # fmt: skip
        yield dc
    finally:
        cluster.down(info.state_dir)


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def phase_is(*phases: str) -> PodPredicate:
    return lambda pod: pod.get("status", {}).get("phase") in phases


def restart_count_at_least(n: int, container: int = 0) -> PodPredicate:
    def check(pod: dict[str, Any]) -> bool:
        statuses = pod.get("status", {}).get("containerStatuses", [])
        return len(statuses) > container and statuses[container].get("restartCount", 0) >= n

    return check
