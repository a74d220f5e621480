"""ownerReferences and the spec hash stamped on children."""

import hashlib
import json
from typing import Any

from tidal.operator.api import constants as c
from tidal.operator.api.resource import InferenceModel


def owner_reference(model: InferenceModel) -> dict[str, Any]:
    """Children point at the model with controller=true, so deleting the model garbage-collects them."""
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": model.metadata.name,
        "uid": model.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(model: InferenceModel, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": model.metadata.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(model)],
    }


def content_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able value (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def stamp_hash(manifest: dict[str, Any], hashed: Any) -> dict[str, Any]:
    """Record what `manifest` was built from in its spec-hash annotation (the planner compares only this)."""
    annotations = manifest["metadata"].setdefault("annotations", {})
    annotations[c.ANNOTATION_SPEC_HASH] = content_hash(hashed)
    return manifest


def spec_hash_of(manifest: dict[str, Any]) -> str:
    """The spec hash `stamp_hash` recorded on a manifest this package built."""
    value: str = manifest["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
    return value
