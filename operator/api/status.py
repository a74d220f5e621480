"""`InferenceModel.status`: what the operator observed. Also part of the CRD schema (one source)."""

from datetime import datetime
from typing import Literal

from pydantic import Field

from tidal.operator.api.base import StatusModel

ConditionType = Literal["Ready", "Progressing", "Degraded", "Sleeping", "WeightsSynced"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Ready", "Progressing", "Degraded", "Sleeping", "WeightsSynced")
ConditionStatus = Literal["True", "False", "Unknown"]
Phase = Literal["Pending", "Loading", "Ready", "Updating", "Sleeping", "Degraded", "Stopped"]
RankState = Literal["Pending", "Loading", "Ready", "Asleep", "Updating", "Failed", "Terminating"]
SleepState = Literal["Awake", "Asleep", "Mixed", "None"]


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
    """Weights version the worker reports."""


class WeightsRolloutStatus(StatusModel):
    """Memory of a failed roll, so it is not retried until spec.weights changes."""

    failed_version: str = Field(max_length=63)
    """Version whose update failed."""
    message: str = Field("", max_length=32768)
    """The failure, as reported by the worker."""


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
    ranks: list[RankStatus] = Field(default_factory=list)
    """Per-rank table."""
    weights_version: str | None = Field(None, max_length=63)
    """Version every rank serves with agreeing checksums; unchanged while a roll is in progress or failed."""
    weights_rollout: WeightsRolloutStatus | None = None
    """Set while a failed roll is held."""
    sleep_state: SleepState = "None"
    """Awake, Asleep, Mixed (some ranks asleep) or None (no ranks)."""
    endpoint: str | None = Field(None, max_length=1024)
    """In-cluster URL of the OpenAI-compatible API."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded, Sleeping, WeightsSynced."""
