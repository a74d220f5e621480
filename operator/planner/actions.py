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

    def describe(self) -> str:
        return f"delete pod {self.name} ({self.reason})"


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
    | SleepRank
    | WakeRank
    | UpdateWeights
    | PatchStatus
    | EmitEvent,
    Field(discriminator="kind"),
]
