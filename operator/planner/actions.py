"""Typed actions the planner asks for. The executor carries them out; each describes itself in one log-safe line."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tidal.operator.api.status import InferenceModelStatus


class _Action(BaseModel):
    def describe(self) -> str:
        raise NotImplementedError


class CreatePod(_Action):
    kind: Literal["CreatePod"] = "CreatePod"
    manifest: dict[str, Any]
    reason: str

    def describe(self) -> str:
        return f"create pod {self.manifest['metadata']['name']} ({self.reason})"


class DeletePod(_Action):
    kind: Literal["DeletePod"] = "DeletePod"
    name: str
    reason: str
    # None: the pod's own terminationGracePeriodSeconds. A failed rank's pod gets a short one: its process has
    # nothing left to drain (a frozen one cannot even take SIGTERM), and its replacement waits for the name.
    grace_period_seconds: int | None = Field(None, ge=0)

    def describe(self) -> str:
        grace = f", grace {self.grace_period_seconds}s" if self.grace_period_seconds is not None else ""
        return f"delete pod {self.name} ({self.reason}{grace})"


class _ChildAction(_Action):
    manifest: dict[str, Any]

    def describe(self) -> str:
        verb = "create" if type(self).__name__.startswith("Create") else "patch"
        return f"{verb} {self.manifest['kind']} {self.manifest['metadata']['name']}"


class CreateService(_ChildAction):
    kind: Literal["CreateService"] = "CreateService"


class PatchService(_ChildAction):
    kind: Literal["PatchService"] = "PatchService"


class CreateNetworkPolicy(_ChildAction):
    kind: Literal["CreateNetworkPolicy"] = "CreateNetworkPolicy"


class PatchNetworkPolicy(_ChildAction):
    kind: Literal["PatchNetworkPolicy"] = "PatchNetworkPolicy"


class CreateSecret(_ChildAction):
    """Carries the token: the manifest is left out of repr and of model_dump, so logging the action is safe."""

    kind: Literal["CreateSecret"] = "CreateSecret"
    manifest: dict[str, Any] = Field(repr=False, exclude=True)


class PatchSecret(_ChildAction):
    """Writes a new token into a Secret that holds none Tidal can read. Carries the token, like CreateSecret."""

    kind: Literal["PatchSecret"] = "PatchSecret"
    manifest: dict[str, Any] = Field(repr=False, exclude=True)


class SleepRank(_Action):
    kind: Literal["SleepRank"] = "SleepRank"
    pod: str
    level: Literal[1, 2]

    def describe(self) -> str:
        return f"sleep {self.pod} (level {self.level})"


class WakeRank(_Action):
    kind: Literal["WakeRank"] = "WakeRank"
    pod: str

    def describe(self) -> str:
        return f"wake {self.pod}"


class UpdateWeights(_Action):
    """POST /weights/update on one rank. All ranks of one replica arrive in the same plan: run them together."""

    kind: Literal["UpdateWeights"] = "UpdateWeights"
    pod: str
    replica: int
    source: str
    version: str

    def describe(self) -> str:
        return f"update weights of {self.pod} to {self.version} from {self.source}"


class EpochMemberRef(BaseModel):
    """One member of an epoch: its rank, its pod, and its group endpoint (podIP:groupPort)."""

    rank: int = Field(ge=0)
    pod: str
    address: str


class ReconfigureGroup(_Action):
    """POST /group/reconfigure of one epoch to every member of a replica's group, each on its own (a slow rank must
    not hold the others). Started before the pass's other writes, and not waited for by the pass."""

    kind: Literal["ReconfigureGroup"] = "ReconfigureGroup"
    replica: int = Field(ge=0)
    epoch: int = Field(ge=1)
    members: list[EpochMemberRef] = Field(min_length=1)
    coordinator_rank: int = Field(ge=0)
    group_size: int = Field(ge=1, description="the epoch's group size: spec.expertParallel (resized by epochs)")
    timeout_s: float = Field(gt=0, description="each member's limit for the rendezvous and installing the map")
    reason: str
    # The survivors' epoch after a failure (members of the serving epoch were dropped): its latency from the
    # failure being observed is measured and logged.
    recovery: bool = False

    def describe(self) -> str:
        ranks = [m.rank for m in self.members]
        return (
            f"reconfigure replica {self.replica}: epoch {self.epoch}, ranks {ranks} of {self.group_size}, "
            f"coordinator {self.coordinator_rank} ({self.reason})"
        )


class SetServingLabel(_Action):
    """Set the pod's `tidal.dev/serving` label, which the serving Service selects on."""

    kind: Literal["SetServingLabel"] = "SetServingLabel"
    pod: str
    serving: bool

    def describe(self) -> str:
        return f"label {self.pod} serving={'true' if self.serving else 'false'}"


class PatchStatus(_Action):
    kind: Literal["PatchStatus"] = "PatchStatus"
    status: InferenceModelStatus

    def describe(self) -> str:
        return f"patch status (phase {self.status.phase}, ready {self.status.ready})"


class EmitEvent(_Action):
    kind: Literal["EmitEvent"] = "EmitEvent"
    type: Literal["Normal", "Warning"]
    reason: str
    message: str

    def describe(self) -> str:
        return f"event {self.type} {self.reason}: {self.message}"


Action = Annotated[
    CreatePod
    | DeletePod
    | CreateService
    | PatchService
    | CreateNetworkPolicy
    | PatchNetworkPolicy
    | CreateSecret
    | PatchSecret
    | SleepRank
    | WakeRank
    | UpdateWeights
    | ReconfigureGroup
    | SetServingLabel
    | PatchStatus
    | EmitEvent,
    Field(discriminator="kind"),
]
