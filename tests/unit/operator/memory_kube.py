"""An in-memory stand-in for `KubeApi`: one model, the objects the operator creates, and a list of its writes.

`refuse_dry_run` and `refuse_create` decide what the API server says of a pod (None admits it), so a test can have
it refuse a template, or admit a dry run and then refuse the real create."""

import copy
import json
from collections.abc import Callable
from typing import Any

from tidal.operator.kube.refusal import Refusal, RefusedError

MODEL = {
    "apiVersion": "tidal.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "tiny", "namespace": "ml", "uid": "uid-1", "generation": 1, "resourceVersion": "1"},
    "spec": {"model": {"volume": {"hostPath": {"path": "/srv/models"}}, "path": "tiny-llama"}},
}

PodVerdict = Callable[[dict[str, Any]], Refusal | None]


def admit(manifest: dict[str, Any]) -> Refusal | None:
    return None


class MemoryKube:
    def __init__(self) -> None:
        self.model: dict | None = copy.deepcopy(MODEL)
        self.objects: dict[tuple[str, str], dict] = {}
        self.writes: list[str] = []
        self.dry_runs: list[str] = []  # names of the pods asked about
        self.refuse_dry_run: PodVerdict = admit
        self.refuse_create: PodVerdict = admit

    async def get_model(self, namespace, name):
        return json.loads(json.dumps(self.model)) if self.model is not None else None

    async def list_model_pods(self, namespace, model):
        return [copy.deepcopy(o) for (kind, _), o in self.objects.items() if kind == "Pod"]

    async def get_child(self, kind, namespace, name):
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def dry_run_pod(self, manifest):
        self.dry_runs.append(manifest["metadata"]["name"])
        return self.refuse_dry_run(manifest)

    async def create(self, manifest):
        key = (manifest["kind"], manifest["metadata"]["name"])
        if key in self.objects:
            return False
        refusal = self.refuse_create(manifest) if manifest["kind"] == "Pod" else None
        if refusal is not None:
            self.writes.append(f"refused {key[0]}/{key[1]}")
            raise RefusedError(refusal)
        obj = copy.deepcopy(manifest)
        obj["metadata"]["uid"] = f"uid-{len(self.objects)}"
        obj["status"] = {"phase": "Pending"} if manifest["kind"] == "Pod" else {}
        self.objects[key] = obj
        self.writes.append(f"create {key[0]}/{key[1]}")
        return True

    async def patch(self, manifest):
        # A merge patch (RFC 7386) into the stored object, as the API server applies it.
        key = (manifest["kind"], manifest["metadata"]["name"])
        if key in self.objects:
            self.objects[key] = merge_patch(self.objects[key], manifest)
        self.writes.append(f"patch {manifest['kind']}")

    async def delete_pod(self, namespace, name, grace_period_seconds=None):
        self.objects.pop(("Pod", name), None)
        self.writes.append(f"delete {name}")

    async def patch_pod_labels(self, namespace, name, labels):
        self.objects[("Pod", name)]["metadata"]["labels"].update(labels)
        self.writes.append(f"label {name} {labels}")

    async def patch_status(self, namespace, name, status):
        self.writes.append("status")
        current = self.model.setdefault("status", {})
        for key, value in status.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value

    async def post_event(self, body, type_, reason, message):
        self.writes.append(f"event {reason}")


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def worker_state(version: str) -> dict:
    """A worker's `/state` answer: loaded, awake, serving `version`."""
    return {
        "sleep_state": "awake", "sleep_level": None, "resident": ["weights", "kv_cache"], "weights_version": version,
        "model_loaded": True, "rank": 0, "world_size": 1, "group_epoch": 0, "coordinator_rank": 0, "group_formed": True,
        "in_flight_requests": 0, "seconds_since_last_request": None,
    }  # fmt: skip


def start_pod(kube: MemoryKube, name: str = "tiny-r0-0") -> None:
    """The pod runs and is ready, as the kubelet would report it."""
    kube.objects[("Pod", name)]["status"] = {
        "phase": "Running",
        "podIP": "127.0.9.1",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
