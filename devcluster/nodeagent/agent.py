"""The node agent: register the node, keep it alive, and keep one PodWorker per pod bound to it (list + watch)."""

import base64
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tidal.devcluster.nodeagent import logserver
from tidal.devcluster.nodeagent.allocators import AddressPool, GpuPool
from tidal.devcluster.nodeagent.config import AgentConfig
from tidal.devcluster.nodeagent.kubeapi import NodeApi
from tidal.devcluster.nodeagent.node import Heartbeat, node_manifest
from tidal.devcluster.nodeagent.podworker import NodeContext, PodWorker

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 10.0


def _cluster_ca(cfg: AgentConfig) -> bytes:
    document = yaml.safe_load(cfg.kubeconfig.read_text())
    return base64.b64decode(document["clusters"][0]["cluster"]["certificate-authority-data"])


class NodeAgent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.api = NodeApi(cfg.kubeconfig)
        allocatable = node_manifest(cfg, "")["status"]["allocatable"]
        self.ctx = NodeContext(
            self.api, cfg, AddressPool(cfg.pod_subnet), GpuPool(cfg.gpus), _cluster_ca(cfg), allocatable
        )
        self.workers: dict[str, PodWorker] = {}
        log_port = 0
        if cfg.serving_cert and cfg.serving_key and cfg.client_ca:
            _, log_port = logserver.serve(cfg.state_dir, cfg.serving_cert, cfg.serving_key, cfg.client_ca)
        self.heartbeat = Heartbeat(self.api, cfg, self.stop, log_port)

    def run(self) -> None:
        self._retry(self.heartbeat.register)
        threading.Thread(target=self.heartbeat.run, name="heartbeat", daemon=True).start()
        while not self.stop.is_set():
            try:
                pods, version = self.api.list_pods(self.cfg.node_name)
                self._sync_all(pods)
                self._watch(version)
            except (ApiException, HTTPError, OSError) as exc:
                if self.stop.is_set():
                    break
                log.warning("pod list/watch failed, relisting in 1 s: %s", exc)
                self.stop.wait(1.0)

    def _retry(self, call: Callable[[], None]) -> None:
        while not self.stop.is_set():
            try:
                call()
                return
            except (ApiException, HTTPError, OSError) as exc:
                log.warning("%s failed, retrying: %s", getattr(call, "__name__", call), exc)
                self.stop.wait(1.0)

    def _watch(self, version: str) -> None:
        for event in self.api.watch_pods(self.cfg.node_name, version, self.cfg.watch_timeout_s):
            if self.stop.is_set():
                return
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":
                log.info("watch ended (%s); relisting", obj.get("message"))
                return
            if kind == "BOOKMARK":
                continue
            if kind == "DELETED":
                self._forget(obj["metadata"]["uid"])
            else:
                self._sync(obj)
        self._reap()

    def _sync_all(self, pods: list[dict[str, Any]]) -> None:
        seen = {pod["metadata"]["uid"] for pod in pods}
        for uid in list(self.workers):
            if uid not in seen:
                self._forget(uid)
        for pod in pods:
            self._sync(pod)
        self._reap()

    def _sync(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is None:
            worker = PodWorker(self.ctx, pod)
            self.workers[uid] = worker
            worker.start()
        else:
            worker.update(pod)

    def _forget(self, uid: str) -> None:
        worker = self.workers.get(uid)
        if worker is not None:
            worker.gone()

    def _reap(self) -> None:
        for uid, worker in list(self.workers.items()):
            if worker.done.is_set():
                del self.workers[uid]

    def shutdown(self) -> None:
        """Stop every pod's processes (in parallel), leaving the API objects as they are, as a stopped kubelet does."""
        self.stop.set()
        threads = [
            threading.Thread(target=w.stop_for_shutdown, args=(SHUTDOWN_GRACE_S,)) for w in self.workers.values()
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S + 2
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
