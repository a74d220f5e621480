"""What the planner is told about the world: pods as Kubernetes reports them, and each rank's worker.

The worker's own `GET /state` model comes from the worker's control-API contract (tidal.contract.control_api); the
planner adds what the executor learns from other calls (the checksum, a failed weight update)."""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from tidal.contract.control_api import WorkerState
from tidal.operator.api import constants as c
from tidal.operator.api import worker_env as env
from tidal.operator.builders import names
from tidal.operator.builders.weights import Weights

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]
CRASH_LOOP_REASON = "CrashLoopBackOff"
# The worker container's port that its group endpoint listens on (expert parallelism; set by the pod builder).
GROUP_PORT_NAME = "group"
POD_KEY = "Pod/"  # how a pod is named among the children ("Kind/name")


class ObservedPod(BaseModel):
    """The facts of one worker pod the planner needs. Its replica and rank are those of its name, which cannot
    change; `labels_edited`: its `tidal.dev/model`, `replica` or `rank` label no longer says so (someone edited or
    removed it), so the Services, the scale selector and the pod list no longer see it for what it is."""

    name: str
    replica: int = Field(ge=0)
    rank: int = Field(ge=0)
    labels_edited: bool = False
    phase: PodPhase = "Pending"
    ready: bool = False
    terminating: bool = False
    spec_hash: str | None = None
    restart_count: int = Field(0, ge=0)
    waiting_reason: str | None = None
    # The worker container's latest end: its current state if it is terminated now, else its lastState. The message
    # is the container's termination message (what the worker wrote, or its log's tail on error).
    terminated: bool = False
    last_exit_code: int | None = None
    last_exit_reason: str | None = None
    last_exit_message: str | None = None
    # Where the executor reaches the rank's control API; with the group port, where its group endpoint listens.
    pod_ip: str | None = None
    group_port: int | None = Field(None, ge=1, le=65535)
    # The pod's `tidal.dev/serving` label as it is now (None: not set).
    serving_label: str | None = None
    # When the worker container's current process started (None: not running).
    started_at: datetime | None = None
    # When the pod last turned Ready (None: not ready).
    ready_since: datetime | None = None
    # The weights its worker loads at start (its TIDAL_WEIGHTS_VERSION and TIDAL_WEIGHTS_PATH; None: not set). An
    # update in place does not change them: they say what the pod serves only until its first update.
    start_version: str | None = None
    start_source: str | None = None

    @property
    def start_weights(self) -> Weights | None:
        return None if self.start_version is None else Weights(self.start_version, self.start_source)

    @property
    def group_address(self) -> str | None:
        """host:port of the rank's group endpoint, once the pod has an IP (expert parallelism only)."""
        if self.pod_ip is None or self.group_port is None:
            return None
        return f"{self.pod_ip}:{self.group_port}"

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
    source: str | None = None  # the directory it was asked to read (None: from an older operator process)


class RankObservation(BaseModel):
    """One rank's worker as seen through its control API; `state` is None while it does not answer."""

    state: WorkerState | None = None
    checksum: str | None = None
    update_failure: UpdateFailure | None = None
    # The worker answered 401: it holds another token than the Secret's (the Secret was re-created), so it can
    # never be controlled again until its pod restarts with the current token.
    token_rejected: bool = False
    # Seconds since this process's `/state` last failed to answer, counted from the first miss in a row (None: it
    # answered, or was never asked). The executor keeps the clock; the planner compares it with its threshold.
    silent_for_s: float | None = Field(None, ge=0)
    # While it does not answer: how many `/state` calls in a row got no answer (0: it answered, or was never asked),
    # and this process's last answer before them with its checksum (None: none yet). The status holds that answer
    # for a few misses (`facts.HOLD_MISSED_READS`); nothing else goes by it.
    missed_reads: int = Field(0, ge=0)
    last_state: WorkerState | None = None
    last_checksum: str | None = None


class EpochRefusal(BaseModel):
    """One member's refusal of a `/group/reconfigure` (the worker's code, or the client's for no answer)."""

    rank: int = Field(ge=0)
    code: str
    message: str


class SentEpoch(BaseModel):
    """The last epoch the operator sent to a replica's group, as this process remembers it (nothing after a
    restart: the planner then goes by what the workers report)."""

    epoch: int = Field(ge=1)
    members: list[int]
    coordinator_rank: int = Field(ge=0)
    sent_at: datetime
    age_s: float = Field(ge=0, description="seconds since it was sent")
    answered: bool = Field(False, description="every member answered (applied or refused)")
    answered_age_s: float | None = Field(None, ge=0, description="seconds since the last answer came")
    applied_at: datetime | None = Field(None, description="when the last member answered that it applied it")
    refusals: list[EpochRefusal] = Field(default_factory=list)

    @property
    def in_flight(self) -> bool:
        return not self.answered

    @property
    def refused(self) -> bool:
        return self.answered and bool(self.refusals)


class ObservedChildren(BaseModel):
    """Services, Secret and NetworkPolicy that exist: "Kind/name" -> their spec-hash annotation ("" if none).

    `foreign`: objects under a child's name (a rank's pod name included) that this model does not control (no
    controller ownerReference to its UID): "Kind/name" -> who controls it. They are never patched, labelled, called,
    adopted or deleted, nothing is created under their names, and the model is Degraded.
    `departing`: pod names held by a pod of someone else's that is on its way out (`sort_strangers`): nothing is
    created under them until it is gone, and no one is to blame.
    `damaged`: children of this model's (keys of `existing`) that hold nothing Tidal can use: the token Secret
    without a readable token (its `token` key missing, empty, or not base64 of UTF-8 text)."""

    existing: dict[str, str] = Field(default_factory=dict)
    foreign: dict[str, str] = Field(default_factory=dict)
    departing: set[str] = Field(default_factory=set)
    damaged: set[str] = Field(default_factory=set)

    def taken_pod_names(self) -> set[str]:
        """Rank pod names that a pod this model does not control holds: no pod is created under them."""
        return {key.removeprefix(POD_KEY) for key in self.foreign if key.startswith(POD_KEY)} | self.departing


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether `obj` has a controller ownerReference to the object with `uid` (what the operator created)."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def controller_of(obj: dict[str, Any]) -> str:
    """Who controls `obj`, for a message: "Kind/name", or "no controller"."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), None)
    return f"{ref.get('kind')}/{ref.get('name')}" if ref is not None else "no controller"


def sort_strangers(pods: list[dict[str, Any]], model: str) -> tuple[dict[str, str], set[str]]:
    """Pods under a rank's name that the model does not control -> (foreign: "Pod/name" -> who controls it, departing:
    the names of those on their way out). On their way out: terminating, or left by an earlier model of the same name
    (a namespace holds one model of a name at a time, so that one is deleted and the garbage collector takes its pods).
    """
    foreign: dict[str, str] = {}
    departing: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata", {})
        refs = meta.get("ownerReferences") or []
        earlier = any(
            ref.get("controller") and ref.get("kind") == c.KIND and ref.get("name") == model
            and str(ref.get("apiVersion", "")).startswith(f"{c.GROUP}/")
            for ref in refs
        )  # fmt: skip
        if meta.get("deletionTimestamp") is not None or earlier:
            departing.add(meta["name"])
        else:
            foreign[f"{POD_KEY}{meta['name']}"] = controller_of(pod)
    return foreign, departing


def child_key(manifest: dict[str, Any]) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def observe_child(manifest: dict[str, Any]) -> tuple[str, str]:
    """(key, hash) of a child read from the API, for ObservedChildren.existing."""
    annotations = manifest.get("metadata", {}).get("annotations") or {}
    return child_key(manifest), annotations.get(c.ANNOTATION_SPEC_HASH, "")


def observe_pod(pod: dict[str, Any], model: str) -> ObservedPod | None:
    """Read a Pod manifest (as the API returns it) of `model`'s into an ObservedPod; None for a pod under none of
    its rank names (not one Tidal built). The name, not the labels, says which rank it is: a label edited by hand
    would otherwise hide the pod, and every pass would create the rank anew under the name it still holds."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    slot = names.rank_of(model, meta["name"])
    if slot is None:
        return None
    replica, rank = slot
    identity = names.identity_labels(model, replica, rank)
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready_cond = next(
        (cond for cond in conditions if cond.get("type") == "Ready" and cond.get("status") == "True"), None
    )
    worker: dict[str, Any] = next((s for s in status.get("containerStatuses") or [] if s.get("name") == "worker"), {})
    state = worker.get("state") or {}
    waiting = state.get("waiting") or {}
    running = state.get("running") or {}
    terminated = state.get("terminated") or (worker.get("lastState") or {}).get("terminated") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    container: dict[str, Any] = next((c_ for c_ in containers if c_.get("name") == "worker"), {})
    ports = container.get("ports") or []
    group_port = next((p.get("containerPort") for p in ports if p.get("name") == GROUP_PORT_NAME), None)
    start = start_weights_env(container)
    return ObservedPod(
        name=meta["name"],
        replica=replica,
        rank=rank,
        labels_edited=any(labels.get(key) != value for key, value in identity.items()),
        phase=status.get("phase", "Pending"),
        ready=ready_cond is not None,
        terminating=meta.get("deletionTimestamp") is not None,
        spec_hash=(meta.get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH),
        restart_count=worker.get("restartCount", 0),
        waiting_reason=waiting.get("reason"),
        terminated="terminated" in state,
        last_exit_code=terminated.get("exitCode"),
        last_exit_reason=terminated.get("reason"),
        last_exit_message=terminated.get("message"),
        pod_ip=status.get("podIP"),
        group_port=group_port,
        serving_label=labels.get(c.LABEL_SERVING),
        started_at=running.get("startedAt"),
        ready_since=ready_cond.get("lastTransitionTime") if ready_cond is not None else None,
        start_version=start.get(env.WEIGHTS_VERSION),
        start_source=start.get(env.WEIGHTS_PATH),
    )


def start_weights_env(container: dict[str, Any]) -> dict[str, str]:
    """The worker container's literal in-place weights variables (name -> value)."""
    return {
        e["name"]: e["value"]
        for e in container.get("env") or []
        if e.get("name") in env.IN_PLACE_ENV_NAMES and isinstance(e.get("value"), str)
    }
