"""Read one model's world from the Kubernetes API: the object, its pods, its other children and the control token."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.merge import CONTROL_PORT_NAME, WORKER_CONTAINER
from tidal.operator.kube.client import KubeApi
from tidal.operator.planner.observed import (
    ObservedChildren,
    ObservedPod,
    controlled_by,
    controller_of,
    observe_child,
    observe_pod,
    sort_strangers,
)
from tidal.operator.runtime.workers import Target


@dataclass(frozen=True)
class KubeObservation:
    body: dict[str, Any]
    model: InferenceModel
    pods: list[ObservedPod]
    targets: dict[str, Target]  # running pods whose control API is worth calling
    children: ObservedChildren
    token: SecretStr | None


def child_names(name: str) -> list[tuple[str, str]]:
    return [
        ("Secret", names.token_secret_name(name)),
        ("Service", names.group_service_name(name)),
        ("Service", names.serving_service_name(name)),
        ("NetworkPolicy", names.network_policy_name(name)),
    ]


def read_token(secret: dict[str, Any] | None) -> SecretStr | None:
    """The Secret's token; None when there is no Secret or it holds no usable token (then it is rewritten)."""
    if secret is None:
        return None
    raw = (secret.get("data") or {}).get(names.TOKEN_SECRET_KEY)
    if not raw:
        return None
    try:
        token = base64.b64decode(raw, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return SecretStr(token) if token else None


def control_port_of(pod: dict[str, Any]) -> int | None:
    """The worker container's control port, as the pod was built (None: not found)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    worker: dict[str, Any] = next((c for c in containers if c.get("name") == WORKER_CONTAINER), {})
    port = next((p.get("containerPort") for p in worker.get("ports") or [] if p.get("name") == CONTROL_PORT_NAME), None)
    return port if isinstance(port, int) else None


def targets_of(pods: list[dict[str, Any]]) -> dict[str, Target]:
    out = {}
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        if status.get("phase") == "Running" and status.get("podIP") and meta.get("deletionTimestamp") is None:
            out[meta["name"]] = Target(address=status["podIP"], uid=meta["uid"], port=control_port_of(pod))
    return out


async def _unlisted_rank_pods(
    kube: KubeApi, model: InferenceModel, listed: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Pods under a rank's name that the model's label list lacks, read by name. The list finds only pods with the
    model's label, and a create under a name a pod holds can only fail: a stranger's pod there (`sort_strangers`),
    or one of the model's own whose label someone removed (`observe_pod`), would have every pass try that create
    again. Only missing ranks are read, so a model whose pods all exist costs no extra call."""
    namespace, name = model.metadata.namespace, model.metadata.name
    listed_names = {p["metadata"]["name"] for p in listed}
    wanted = names.rank_pod_names(name, model.spec.replicas, model.spec.expert_parallel)
    read = await asyncio.gather(*(kube.get_child("Pod", namespace, n) for n in wanted if n not in listed_names))
    return [p for p in read if p is not None]


async def observe_kube(kube: KubeApi, body: dict[str, Any], model: InferenceModel) -> KubeObservation:
    namespace, name = model.metadata.namespace, model.metadata.name
    wanted = child_names(name)
    raw_pods, *children = await asyncio.gather(
        kube.list_model_pods(namespace, name), *(kube.get_child(kind, namespace, n) for kind, n in wanted)
    )
    uid = model.metadata.uid
    found = raw_pods + await _unlisted_rank_pods(kube, model, raw_pods)
    # Pods of an earlier model with the same name (still being garbage-collected) are not this model's.
    mine = [p for p in found if controlled_by(p, uid)]
    rank_names = set(names.rank_pod_names(name, model.spec.replicas, model.spec.expert_parallel))
    strangers = sort_strangers(
        [p for p in found if p["metadata"]["name"] in rank_names and not controlled_by(p, uid)], name
    )
    pods = [obs for obs in (observe_pod(p, name) for p in mine) if obs is not None]
    existing: dict[str, str] = {}
    foreign: dict[str, str] = {}
    for (kind, _), child in zip(wanted, children, strict=True):
        if not child:
            continue
        key, spec_hash = observe_child({**child, "kind": kind})
        if controlled_by(child, uid):
            existing[key] = spec_hash
        else:  # someone else's object under our child's name: never patched, adopted or read
            foreign[key] = controller_of(child)
    secret = children[0]
    token = read_token(secret) if secret and controlled_by(secret, uid) else None
    secret_key = f"Secret/{names.token_secret_name(name)}"
    damaged = {secret_key} if secret_key in existing and token is None else set()
    return KubeObservation(
        body=body,
        model=model,
        pods=pods,
        targets={k: v for k, v in targets_of(mine).items() if any(p.name == k for p in pods)},
        children=ObservedChildren(
            existing=existing, foreign={**foreign, **strangers[0]}, departing=strangers[1], damaged=damaged
        ),
        token=token,
    )
