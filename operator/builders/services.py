"""The model's two Services: a headless one for per-rank DNS, and the serving one that selects the ranks that serve."""

from typing import Any

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.owner import object_meta, stamp_hash


def build_group_service(model: InferenceModel) -> dict[str, Any]:
    """Headless, and publishing not-ready pods: ranks must find each other while they are still loading."""
    name = model.metadata.name
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(model, names.group_service_name(name), names.model_labels(name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.model_selector(name),
            "ports": [{"name": "serve", "port": model.spec.serving.port, "targetPort": "serve", "protocol": "TCP"}],
        },
    }
    return stamp_hash(svc, svc["spec"])


def build_serving_service(model: InferenceModel) -> dict[str, Any]:
    """Clients' entry point: every pod labelled serving takes requests (with expertParallel 1 that is every pod; in a
    group, each rank while it steps in its group's epoch). The control port is deliberately not exposed."""
    name = model.metadata.name
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(model, names.serving_service_name(name), names.model_labels(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": names.serving_selector(name),
            "ports": [{"name": "http", "port": model.spec.serving.port, "targetPort": "serve", "protocol": "TCP"}],
        },
    }
    return stamp_hash(svc, svc["spec"])


def endpoint(model: InferenceModel) -> str:
    name, namespace = model.metadata.name, model.metadata.namespace
    return f"http://{names.serving_service_name(name)}.{namespace}.svc:{model.spec.serving.port}"
