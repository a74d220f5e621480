"""The Node object and its heartbeat (Lease renewals, Ready condition): manifests are pure, `Heartbeat` does I/O."""

import datetime as dt
import logging
import platform
import threading
from typing import Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tidal.devcluster.nodeagent.config import AgentConfig
from tidal.devcluster.nodeagent.kubeapi import NodeApi
from tidal.devcluster.nodeagent.lifecycle import now_iso

log = logging.getLogger(__name__)

HOST_IP = "127.0.0.1"
LEASE_DURATION_S = 40
AGENT_VERSION = "v1.36.3-tidal-node-agent"


def _arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def ready_conditions(now: str, since: str) -> list[dict[str, Any]]:
    pressure = [
        {
            "type": t,
            "status": "False",
            "reason": f"KubeletHas{r}",
            "message": m,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }
        for t, r, m in (
            ("MemoryPressure", "SufficientMemory", "the node agent does not track memory pressure"),
            ("DiskPressure", "NoDiskPressure", "the node agent does not track disk pressure"),
            ("PIDPressure", "SufficientPID", "the node agent does not track PID pressure"),
        )
    ]
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "tidal node agent is posting ready status (runs pod commands as local processes)",
        "lastHeartbeatTime": now,
        "lastTransitionTime": since,
    }
    return [*pressure, ready]


def node_manifest(cfg: AgentConfig, since: str, log_port: int = 0) -> dict[str, Any]:
    capacity = {
        "cpu": cfg.cpu,
        "memory": cfg.memory,
        "pods": str(cfg.max_pods),
        "ephemeral-storage": "100Gi",
        "nvidia.com/gpu": str(cfg.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": cfg.node_name,
            "labels": {
                "kubernetes.io/hostname": cfg.node_name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": _arch(),
                "tidal.dev/devcluster": "true",
            },
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": ready_conditions(since, since),
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": cfg.node_name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "tidal devcluster (local processes)",
                "containerRuntimeVersion": "tidal-node-agent://1",
                "kubeletVersion": AGENT_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": _arch(),
            },
        },
    }


def lease_manifest(node_name: str, node_uid: str) -> dict[str, Any]:
    renew = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node_name,
            "namespace": "kube-node-lease",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}],
        },
        "spec": {"holderIdentity": node_name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": renew},
    }


class Heartbeat:
    """Registers the node, then renews its Lease every `lease_period_s` and re-posts Ready every `status_period_s`."""

    def __init__(self, api: NodeApi, cfg: AgentConfig, stop: threading.Event, log_port: int = 0) -> None:
        self._api = api
        self._log_port = log_port
        self._cfg = cfg
        self._stop = stop
        self._since = now_iso()
        self._node_uid = ""

    def register(self) -> None:
        self._api.create_or_update_node(node_manifest(self._cfg, self._since, self._log_port))
        self._node_uid = self._api.node_uid(self._cfg.node_name)
        self._api.renew_lease(lease_manifest(self._cfg.node_name, self._node_uid))
        log.info("registered node %s (%d GPUs)", self._cfg.node_name, self._cfg.gpus)

    def run(self) -> None:
        last_status = 0.0
        while not self._stop.wait(self._cfg.lease_period_s):
            try:
                self._api.renew_lease(lease_manifest(self._cfg.node_name, self._node_uid))
                last_status += self._cfg.lease_period_s
                if last_status >= self._cfg.status_period_s:
                    last_status = 0.0
                    self._api.patch_node_status(
                        self._cfg.node_name, {"conditions": ready_conditions(now_iso(), self._since)}
                    )
            except (ApiException, HTTPError, OSError) as exc:
                # The apiserver may be restarting; the next period tries again (the lease outlives a few misses).
                log.warning("heartbeat failed: %s", exc)
