"""`InferenceModel.status`: what the operator observed. Also part of the CRD schema (one source)."""

from datetime import datetime
from typing import Any, Literal, Self

from pydantic import Field, PrivateAttr

from tidal.operator.api.base import StatusModel
from tidal.operator.api.lenient import read_leniently

ConditionType = Literal["Ready", "Progressing", "Degraded", "Sleeping", "WeightsSynced"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Ready", "Progressing", "Degraded", "Sleeping", "WeightsSynced")
ConditionStatus = Literal["True", "False", "Unknown"]
Phase = Literal["Pending", "Loading", "Ready", "Updating", "Sleeping", "Degraded", "Stopped"]
RankState = Literal["Pending", "Loading", "Ready", "Asleep", "Updating", "Failed", "Terminating", "Uncontrolled"]
SleepState = Literal["Awake", "Asleep", "Mixed", "None"]
# A rank's place in its expert-parallel group: Loading (pod starting or model loading), Joining (loaded, not yet in
# the current epoch), Serving (steps in the current epoch), Broken (a member of the current epoch whose group broke;
# it keeps its requests and waits for the next epoch), Failed (gone, not answering, or named by a peer).
GroupRankState = Literal["Loading", "Joining", "Serving", "Broken", "Failed"]
# A replica's group: Forming (no epoch yet), Whole (every rank serves), Degraded (the survivors serve),
# Reconfiguring (an epoch was sent and is not applied yet), Broken (the current epoch broke; none sent yet).
GroupState = Literal["Forming", "Whole", "Degraded", "Reconfiguring", "Broken"]


class Condition(StatusModel):
    """One condition, the Kubernetes way."""

    type: ConditionType
    """Which aspect this condition describes."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_]*[A-Za-z0-9])?$")
    """One CamelCase word a program can match on."""
    message: str = Field("", max_length=32768)
    """What a person should know."""
    last_transition_time: datetime
    """When status last changed (not when the reason or message did)."""
    observed_generation: int | None = Field(None, ge=0)
    """metadata.generation this condition was computed for."""


class RankStatus(StatusModel):
    """One row of the per-rank table."""

    pod: str = Field(max_length=253)
    """Pod name."""
    replica: int = Field(ge=0)
    """Replica index."""
    rank: int = Field(ge=0)
    """Rank within the replica."""
    state: RankState
    """What the rank is doing."""
    weights_version: str | None = Field(None, max_length=63)
    """Weights version the worker reports serving (an Uncontrolled rank: the last one it reported)."""
    weights_source: str | None = Field(None, max_length=4096)
    """Directory (in the pod) the worker reports reading them from (unset where it reports none)."""
    group_state: GroupRankState | None = None
    """With expertParallel above 1: the rank's place in its group."""


class RecoveryStatus(StatusModel):
    """The last time a group lost a rank, and how it came back."""

    failed_ranks: list[int] = Field(default_factory=list)
    """Ranks that left the group (more than one when a second fails before the group is whole again)."""
    reason: str = Field("", max_length=1024)
    """Why the first of them was found failed."""
    failed_epoch: int = Field(0, ge=0)
    """The epoch that lost the rank."""
    failure_seen_at: datetime
    """When the operator observed the failure."""
    survivors_epoch: int | None = Field(None, ge=1)
    """The first epoch without the failed ranks that served."""
    survivors_serving_at: datetime | None = None
    """When the survivors served again (their epoch applied)."""
    whole_at: datetime | None = None
    """When the group served with every rank again."""
    interruption_seconds: float | None = Field(None, ge=0)
    """From the failure seen to the survivors serving; unset when the failure was found only from the epochs (the
    operator restarted between the failure and its record, and the survivors' epoch was already out)."""


class ReplicaGroupStatus(StatusModel):
    """One replica's expert-parallel group."""

    replica: int = Field(ge=0)
    """Replica index."""
    state: GroupState
    """Forming, Whole, Degraded, Reconfiguring or Broken."""
    epoch: int = Field(0, ge=0)
    """The membership epoch the ranks serve (or last served) in; 0 before the first."""
    members: list[int] = Field(default_factory=list)
    """Ranks of that epoch."""
    coordinator_rank: int | None = Field(None, ge=0)
    """The member that hosted the epoch's rendezvous and planned its expert map."""
    degraded_experts: list[int] = Field(default_factory=list)
    """Experts no member held when the epoch began, reloaded from the checkpoint for it."""
    message: str = Field("", max_length=32768)
    """What is going on (an epoch in flight, a refusal)."""
    last_recovery: RecoveryStatus | None = None
    """The last loss of a rank and its recovery."""


class WeightsRolloutStatus(StatusModel):
    """Memory of a failed roll, so it is not retried until spec.weights changes."""

    failed_version: str = Field(max_length=63)
    """Version whose update failed."""
    failed_source: str | None = Field(None, max_length=4096)
    """Directory (in the pods) it was read from; the same version from another directory is tried again."""
    message: str = Field("", max_length=32768)
    """The failure, as reported by the worker."""


class IdleClockStatus(StatusModel):
    """The idle timeout the operator counts against, and since when it does."""

    seconds: int = Field(ge=1)
    """spec.sleep.idleTimeoutSeconds as the operator last saw it."""
    since: datetime
    """When the operator first saw that value. The model sleeps for idleness no sooner than that many seconds after
    it, however long it was idle before the timeout was set or changed."""


class InferenceModelStatus(StatusModel):
    """Observed state of an InferenceModel."""

    observed_generation: int | None = Field(None, ge=0)
    """metadata.generation the status was computed for."""
    phase: Phase = "Pending"
    """One word summary (see docs/API.md)."""
    ready_ranks: int = Field(0, ge=0)
    """Ranks whose pod is ready."""
    total_ranks: int = Field(0, ge=0)
    """Ranks the spec asks for (replicas x expertParallel)."""
    ready: str = Field("0/0", max_length=32)
    """readyRanks/totalRanks, for kubectl get."""
    replicas: int = Field(0, ge=0)
    """Replicas that have a pod (not terminating), counted in the unit of spec.replicas: a replica is a group of
    expertParallel ranks. The scale subresource's current count (`kubectl scale`, HorizontalPodAutoscaler, KEDA)."""
    selector: str | None = Field(None, max_length=512)
    """Label selector of the pod an autoscaler counts as each replica: its rank 0 (every pod with expertParallel
    1). The scale subresource's selector; HPA averages pod metrics over these pods."""
    ranks: list[RankStatus] = Field(default_factory=list)
    """Per-rank table."""
    weights_version: str | None = Field(None, max_length=63)
    """Version every rank served with agreeing checksums when they last agreed. It stays while a roll is in progress
    or stopped, when ranks may serve others: ranks[].weightsVersion says what each serves."""
    weights_source: str | None = Field(None, max_length=4096)
    """Directory (in the pods) weightsVersion was read from: a pod created while a roll is held starts on it."""
    weights_rollout: WeightsRolloutStatus | None = None
    """Set while a failed roll is held."""
    sleep_state: SleepState = "None"
    """Awake, Asleep, Mixed (some ranks asleep) or None (no ranks)."""
    idle_clock: IdleClockStatus | None = None
    """While spec.sleep.idleTimeoutSeconds is set: the timeout and when it was set or last changed."""
    endpoint: str | None = Field(None, max_length=1024)
    """In-cluster URL of the OpenAI-compatible API."""
    groups: list[ReplicaGroupStatus] = Field(default_factory=list)
    """With expertParallel above 1: each replica's group."""
    group_summary: str | None = Field(None, max_length=128)
    """With expertParallel above 1: the groups at a glance, for kubectl get (`Whole @7` for one replica whose group
    serves whole in epoch 7; `1/2 Whole, r1 Degraded @9` for two)."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded, Sleeping, WeightsSynced."""

    # What `read` dropped (paths): a status holding values this operator does not know. Private, so not in the
    # schema; pydantic compares it too, so such a status never equals a computed one and is always written anew.
    _unread: tuple[str, ...] = PrivateAttr(default=())

    @property
    def unread(self) -> tuple[str, ...]:
        return self._unread

    @classmethod
    def read(cls, data: Any) -> Self:
        """The status as the API returns it, read leniently (`api/lenient.py`): a value this operator does not know
        is dropped and noted in `unread`, not refused."""
        status, dropped = read_leniently(cls, data)
        status._unread = dropped
        return status
