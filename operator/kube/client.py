"""The operator's calls to the Kubernetes API: read a model and its children, create/patch/delete them, post Events.

The official client is synchronous; each call runs in a thread of the client's own pool (sized with the HTTP
connection pool, `API_CONCURRENCY`) so one slow call does not hold kopf's event loop and many models reconcile at once
(asyncio's default pool has min(32, CPUs + 4) threads: 6 on a 2-core machine, which queued every call behind others).
Reads use `_preload_content=False` and return the API's own JSON (camelCase dicts), the
shape the planner's observers and the builders' manifests use.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tidal.operator.api import constants as c
from tidal.operator.kube.merge_patch import service_patch
from tidal.operator.kube.refusal import Refusal, RefusedError, refusal_of

MERGE_PATCH = "application/merge-patch+json"
API_CONCURRENCY = 32
EVENT_SOURCE = "tidal-operator"


def _json(resp: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(resp.data)
    return body


class KubeApi:
    def __init__(self, api_client: client.ApiClient, reporting_instance: str) -> None:
        self.core = client.CoreV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._instance = reporting_instance
        self._pool = ThreadPoolExecutor(API_CONCURRENCY, thread_name_prefix="kube-api")

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- reads -------------------------------------------------------------------------------------------------
    async def get_model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._maybe(
            self.custom.get_namespaced_custom_object, c.GROUP, c.VERSION, namespace, c.PLURAL, name,
            _preload_content=False,
        )  # fmt: skip

    async def list_model_pods(self, namespace: str, model: str) -> list[dict[str, Any]]:
        resp = await self._call(
            self.core.list_namespaced_pod, namespace, label_selector=f"{c.LABEL_MODEL}={model}", _preload_content=False
        )
        pods: list[dict[str, Any]] = _json(resp)["items"]
        return pods

    async def get_child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = {
            "Pod": self.core.read_namespaced_pod,
            "Service": self.core.read_namespaced_service,
            "Secret": self.core.read_namespaced_secret,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }[kind]
        return await self._maybe(read, name, namespace, _preload_content=False)

    # -- writes ------------------------------------------------------------------------------------------------
    async def create(self, manifest: dict[str, Any]) -> bool:
        """Create a child; False if it already exists (another pass or a restarted operator got there first).
        Raises RefusedError when the API server refuses the object itself."""
        create = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }[manifest["kind"]]
        try:
            await self._call(create, manifest["metadata"]["namespace"], manifest, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            refusal = refusal_of(exc)
            if refusal is not None:
                raise RefusedError(refusal) from exc
            raise
        return True

    async def dry_run_pod(self, manifest: dict[str, Any]) -> Refusal | None:
        """Ask the API server whether it would create this pod (decoding, validation, admission), creating nothing;
        None when it would. The pod's own name may be taken (by the pod it is to replace), so the question is asked
        under a generated name, which the answer's message then calls by the pod's name again."""
        meta = manifest["metadata"]
        pod = copy.deepcopy(manifest)
        del pod["metadata"]["name"]
        pod["metadata"]["generateName"] = f"{meta['name']}-"
        try:
            await self._call(
                self.core.create_namespaced_pod, meta["namespace"], pod, dry_run="All", _preload_content=False
            )
        except ApiException as exc:
            refusal = refusal_of(exc)
            if refusal is None:
                raise
            if refusal.name and refusal.name != meta["name"]:
                refusal = Refusal(refusal.code, refusal.message.replace(refusal.name, meta["name"]), meta["name"])
            return refusal
        return None

    async def patch(self, manifest: dict[str, Any]) -> None:
        patch = {
            "Secret": self.core.patch_namespaced_secret,
            "Service": self.core.patch_namespaced_service,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
        }[manifest["kind"]]
        meta = manifest["metadata"]
        body = manifest
        if manifest["kind"] == "Service":
            # Read first: removing a selector key needs its name (see merge_patch.py). Patches are rare (a spec
            # hash changed), so the extra read costs nothing that matters.
            body = service_patch(manifest, await self.get_child("Service", meta["namespace"], meta["name"]))
        await self._call(
            patch, meta["name"], meta["namespace"], body, _content_type=MERGE_PATCH, _preload_content=False
        )

    async def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None) -> None:
        try:
            await self._call(
                self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=grace_period_seconds,
                _preload_content=False,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        """Merge `labels` into a pod's labels; a pod that is gone is fine (its replacement is labelled later)."""
        try:
            await self._call(
                self.core.patch_namespaced_pod, name, namespace, {"metadata": {"labels": labels}},
                _content_type=MERGE_PATCH, _preload_content=False,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            c.GROUP, c.VERSION, namespace, c.PLURAL, name, {"status": status},
            _content_type=MERGE_PATCH, _preload_content=False,
        )  # fmt: skip

    async def post_event(self, model: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the model (what `kubectl describe` lists)."""
        meta = model["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": c.API_VERSION,
                "kind": c.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": EVENT_SOURCE},
            "reportingComponent": EVENT_SOURCE,
            "reportingInstance": self._instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._call(self.core.create_namespaced_event, meta["namespace"], event, _preload_content=False)

    async def _maybe(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        try:
            return _json(await self._call(fn, *args, **kwargs))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
