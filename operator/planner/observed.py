"""What the planner is told about the world: pods as Kubernetes reports them, and each rank's worker.

The worker's own `GET /state` model comes from the worker's control-API contract (tidal.contract.control_api); the
planner adds what the executor learns from other calls (the checksum, a failed weight update)."""

from typing import Any, Literal

from pydantic import BaseModel, Field

from tidal.contract.control_api import WorkerState
from tidal.operator.api import constants as c

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]
CRASH_LOOP_REASON = "CrashLoopBackOff"


class ObservedPod(BaseModel):
    """The facts of one worker pod the planner needs."""

    name: str
    replica: int = Field(ge=0)
    rank: int = Field(ge=0)
    phase: PodPhase = "Pending"
    ready: bool = False
    terminating: bool = False
    spec_hash: str | None = None
    restart_count: int = Field(0, ge=0)
    waiting_reason: str | None = None
    last_exit_message: str | None = None
    # Where the executor reaches the rank's control API (the planner itself never uses it).
    pod_ip: str | None = None

    @property
    def crash_looping(self) -> bool:
        return self.waiting_reason == CRASH_LOOP_REASON

    @property
    def finished(self) -> bool:
        """Pods with restartPolicy Always end only by eviction or node loss; such a pod never comes back."""
        return self.phase in ("Succeeded", "Failed")


class UpdateFailure(BaseModel):
    """A `POST /weights/update` that the worker refused or that failed (the worker kept its old weights)."""

    version: str
    message: str


class RankObservation(BaseModel):
    """One rank's worker as seen through its control API; `state` is None while it does not answer."""

    state: WorkerState | None = None
    checksum: str | None = None
    update_failure: UpdateFailure | None = None
    # The worker answered 401: it holds another token than the Secret's (the Secret was re-created), so it can
    # never be controlled again until its pod restarts with the current token.
    token_rejected: bool = False


class ObservedChildren(BaseModel):
    """Services, Secret and NetworkPolicy that exist: "Kind/name" -> their spec-hash annotation ("" if none)."""

    existing: dict[str, str] = Field(default_factory=dict)


def child_key(manifest: dict[str, Any]) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def observe_child(manifest: dict[str, Any]) -> tuple[str, str]:
    """(key, hash) of a child read from the API, for ObservedChildren.existing."""
    annotations = manifest.get("metadata", {}).get("annotations") or {}
    return child_key(manifest), annotations.get(c.ANNOTATION_SPEC_HASH, "")


def observe_pod(pod: dict[str, Any]) -> ObservedPod | None:
    """Read a Pod manifest (as the API returns it) into an ObservedPod; None for pods without Tidal's labels."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    replica, rank = labels.get(c.LABEL_REPLICA, ""), labels.get(c.LABEL_RANK, "")
    if not (replica.isdigit() and rank.isdigit()):
        return None  # not a pod Tidal built (or its labels were edited): the planner leaves it alone
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(cond.get("type") == "Ready" and cond.get("status") == "True" for cond in conditions)
    worker: dict[str, Any] = next((s for s in status.get("containerStatuses") or [] if s.get("name") == "worker"), {})
    waiting = (worker.get("state") or {}).get("waiting") or {}
    terminated = (worker.get("lastState") or {}).get("terminated") or {}
    return ObservedPod(
        name=meta["name"],
        replica=int(replica),
        rank=int(rank),
        phase=status.get("phase", "Pending"),
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        spec_hash=(meta.get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH),
        restart_count=worker.get("restartCount", 0),
        waiting_reason=waiting.get("reason"),
        last_exit_message=terminated.get("message") or terminated.get("reason"),
        pod_ip=status.get("podIP"),
    )
