"""The InferenceModel CustomResourceDefinition, built from the pydantic models."""

from typing import Any

from tidal.operator.api import constants as c
from tidal.operator.api.resource import InferenceModel
from tidal.operator.schema.openapi import to_structural

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "One word summary"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready ranks / total ranks"},
    {"name": "Weights", "type": "string", "jsonPath": ".status.weightsVersion", "description": "Served weights"},
    {"name": "Sleep", "type": "string", "jsonPath": ".status.sleepState", "description": "Awake, Asleep or Mixed"},
    {
        "name": "Groups",
        "type": "string",
        "jsonPath": ".status.groupSummary",
        "description": "Expert-parallel groups: state and epoch",
    },
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "priority": 1},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# `kubectl scale`, the HorizontalPodAutoscaler and KEDA read and write spec.replicas through the scale subresource;
# the current count and the pods standing for the replicas come from status (planner/scale.py). A scale goes through
# the object's own validation, so spec.replicas' bounds hold for it too.
SCALE_SUBRESOURCE: dict[str, str] = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}


def openapi_schema() -> dict[str, Any]:
    """The version's openAPIV3Schema: the resource model converted, with the root fields the API server owns."""
    source = InferenceModel.model_json_schema(by_alias=True)
    # apiVersion, kind and metadata are validated by the API server itself; a CRD may only say they exist, and
    # declare metadata.name (typed only: the root rules check it, and their fieldPath must find it here).
    source["properties"].update(
        apiVersion={"type": "string", "description": c.API_VERSION},
        kind={"type": "string", "description": c.KIND},
        metadata={"type": "object", "properties": {"name": {"type": "string"}}},
    )
    source["required"] = ["spec"]
    return to_structural(source)


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": c.CRD_NAME, "labels": {c.LABEL_PART_OF: c.PART_OF}},
        "spec": {
            "group": c.GROUP,
            "names": {
                "kind": c.KIND,
                "listKind": c.LIST_KIND,
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": list(c.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": dict(SCALE_SUBRESOURCE)},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }
