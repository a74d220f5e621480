"""The node agent's API calls, returning plain dicts (the JSON the API server sent) rather than client models.

Plain dicts keep the pure modules free of the client's types and skip its (slow) model deserialization.
"""

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tidal.devcluster.nodeagent.envresolve import decode_secret


def _json(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body


class NodeApi:
    def __init__(self, kubeconfig: Path) -> None:
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        self.server = cfg.host
        self.api_client = client.ApiClient(cfg)
        # Any: every call sends plain dicts and reads the raw response (_preload_content=False), which the client's
        # annotations (its models in, its models out) do not describe.
        self.core: Any = client.CoreV1Api(self.api_client)
        self.coordination: Any = client.CoordinationV1Api(self.api_client)

    # -- pods --------------------------------------------------------------------------------------------------
    def list_pods(self, node_name: str) -> tuple[list[dict[str, Any]], str]:
        body = _json(
            self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node_name}", _preload_content=False)
        )
        return body["items"], body["metadata"]["resourceVersion"]

    def watch_pods(self, node_name: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        """Raw watch events ({type, object}); ends after timeout_s, or on an ERROR event (e.g. 410 Gone)."""
        stream = watch.Watch().stream(
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node_name}",
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
            deserialize=False,
        )
        yield from stream

    def patch_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(name, namespace, {"status": status}, _preload_content=False)

    def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet's final delete: grace 0, and only this incarnation of the name (uid precondition)."""
        try:
            self.core.delete_namespaced_pod(
                name, namespace, body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}, _preload_content=False
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def record_event(self, pod: dict[str, Any], event_type: str, reason: str, message: str, node_name: str) -> None:
        meta = pod["metadata"]
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "kubelet", "host": node_name},
            "reportingComponent": "kubelet",
            "reportingInstance": node_name,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        self.core.create_namespaced_event(meta["namespace"], event, _preload_content=False)

    # -- what a pod's environment and identity need ------------------------------------------------------------
    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            body = _json(self.core.read_namespaced_secret(name, namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return decode_secret(body.get("data"))

    def config_map_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            body = _json(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(body.get("data") or {})

    def service_account_token(
        self, namespace: str, sa: str, pod_name: str, pod_uid: str, seconds: int
    ) -> dict[str, Any]:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid},
            },
        }
        return _json(self.core.create_namespaced_service_account_token(sa, namespace, body, _preload_content=False))

    # -- the node and its lease --------------------------------------------------------------------------------
    def create_or_update_node(self, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        try:
            self.core.create_node(node, _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(name, {"metadata": {"labels": node["metadata"]["labels"]}}, _preload_content=False)
        self.core.patch_node_status(name, {"status": node["status"]}, _preload_content=False)

    def patch_node_status(self, name: str, status: dict[str, Any]) -> None:
        self.core.patch_node_status(name, {"status": status}, _preload_content=False)

    def node_uid(self, name: str) -> str:
        uid: str = _json(self.core.read_node(name, _preload_content=False))["metadata"]["uid"]
        return uid

    def renew_lease(self, lease: dict[str, Any]) -> None:
        name, namespace = lease["metadata"]["name"], lease["metadata"]["namespace"]
        try:
            current = _json(self.coordination.read_namespaced_lease(name, namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(namespace, lease, _preload_content=False)
            return
        current["spec"] = lease["spec"]
        self.coordination.replace_namespaced_lease(name, namespace, current, _preload_content=False)
