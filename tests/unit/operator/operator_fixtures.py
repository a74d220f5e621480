"""Small builders of planner inputs for the operator's unit tests."""

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import SecretStr

from tidal.contract.control_api import ResidentTag, SleepState, WorkerState
from tidal.operator.api import constants as c
from tidal.operator.api import worker_env as env
from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.networkpolicy import OperatorIdentity, build_network_policy
from tidal.operator.builders.pod import build_pod
from tidal.operator.builders.secret import build_token_secret
from tidal.operator.builders.services import build_group_service, build_serving_service
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.observed import (
    ObservedChildren,
    ObservedPod,
    RankObservation,
    observe_child,
    start_weights_env,
)
from tidal.operator.planner.plan import Plan, plan

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TOKEN = SecretStr("t" * 48)
OPERATOR = OperatorIdentity(namespace="tidal-system", pod_labels={"app.kubernetes.io/name": "tidal-operator"})


def make_model(spec: dict[str, Any] | None = None, name: str = "tiny", generation: int = 1) -> InferenceModel:
    base = {"model": {"volume": {"hostPath": {"path": "/srv/models"}}, "path": "tiny-llama"}}
    merged = {**base, **(spec or {})}
    return InferenceModel.model_validate(
        {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "metadata": {"name": name, "namespace": "ml", "uid": "uid-1", "generation": generation},
            "spec": merged,
        }
    )


def pod_for(model: InferenceModel, replica: int, rank: int = 0, **over: Any) -> ObservedPod:
    """A running, ready pod built from the current spec (so its hash and start weights are current) unless
    overridden."""
    built = build_pod(model, replica, rank)
    start = start_weights_env(built["spec"]["containers"][0])
    fields = {
        "name": built["metadata"]["name"],
        "replica": replica,
        "rank": rank,
        "phase": "Running",
        "ready": True,
        "spec_hash": built["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH],
        # The builder labels an expertParallel 1 pod serving at creation (one of a group: not yet).
        "serving_label": built["metadata"]["labels"].get(
            c.LABEL_SERVING, "true" if model.spec.expert_parallel == 1 else "false"
        ),
        "start_version": start[env.WEIGHTS_VERSION],
        "start_source": start[env.WEIGHTS_PATH],
    }
    return ObservedPod(**{**fields, **over})


def worker(
    version: str = "base",
    checksum: str | None = "sum-base",
    asleep: bool = False,
    level: int | None = None,
    **over: Any,
) -> RankObservation:
    state = {
        "sleep_state": SleepState.ASLEEP if asleep else SleepState.AWAKE,
        "sleep_level": (level or 1) if asleep else None,
        "resident": [] if asleep else [ResidentTag.WEIGHTS, ResidentTag.KV_CACHE],
        "weights_version": version,
        "model_loaded": True,
        "rank": 0,
        "world_size": 1,
        "group_epoch": 0,
        "coordinator_rank": 0,
        "group_formed": True,
        "in_flight_requests": 0,
        "seconds_since_last_request": 5.0,
    }
    failure = over.pop("update_failure", None)
    state.update(over)
    return RankObservation(state=WorkerState(**state), checksum=checksum, update_failure=failure)


def all_children(model: InferenceModel) -> ObservedChildren:
    """Children as they exist after a first pass (hashes current)."""
    built = [
        build_group_service(model),
        build_serving_service(model),
        build_network_policy(model, OPERATOR),
        build_token_secret(model, TOKEN),
    ]
    return ObservedChildren(existing=dict(observe_child(m) for m in built))


def healthy(model: InferenceModel, version: str = "base", checksum: str = "sum-base"):
    """Pods and worker states of a model whose every rank is ready and awake on `version`."""
    pods, ranks = [], {}
    for replica in range(model.spec.replicas):
        for rank in range(model.spec.expert_parallel):
            pod = pod_for(model, replica, rank)
            pods.append(pod)
            ranks[pod.name] = worker(version, checksum)
    return pods, ranks


def run(
    model: InferenceModel,
    pods: list[ObservedPod],
    ranks: dict[str, RankObservation],
    children: ObservedChildren | None = None,
    minutes: int = 0,
    refusals: dict[str, str] | None = None,
) -> Plan:
    """`refusals`: spec hash -> the API server's message, for pods it refuses."""
    return plan(
        PlanInput(
            model=model,
            pods=pods,
            ranks=ranks,
            children=children if children is not None else all_children(model),
            operator=OPERATOR,
            now=T0 + timedelta(minutes=minutes),
            fresh_token=TOKEN,
            pod_refusals=refusals or {},
        )
    )


def with_status(model: InferenceModel, result: Plan) -> InferenceModel:
    """The model as the next pass reads it back, status included (through JSON, like the API)."""
    data = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["status"] = result.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return InferenceModel.model_validate(copy.deepcopy(data))


def kinds(result: Plan) -> list[str]:
    return [a.kind for a in result.actions]


def pod_name(model: InferenceModel, replica: int, rank: int = 0) -> str:
    return names.pod_name(model.metadata.name, replica, rank)
