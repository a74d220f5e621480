"""Request and response models of the worker's control API: the contract between the operator and each worker.

Both sides import these models (the worker validates requests with them, the operator's client builds requests and
parses responses with them), so a field renamed here is renamed for both at once. This module must stay importable
without torch: the operator image does not install it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.contract.error_codes import ErrorCode

CONTROL_API_VERSION = "v1"
TOKEN_HEADER = "Authorization"  # "Bearer <token>"
# Largest group epoch: an int64, what the operator's status (a Kubernetes integer) can hold. A worker that applied a
# larger one would refuse every epoch the operator can send as stale, until it restarts.
MAX_EPOCH = 2**63 - 1


class _Model(BaseModel):
    # Requests: unknown fields are rejected so that a typo in a request is an error, not a silently ignored option.
    # Their numbers and flags are strict (`strict=True` on each): lax validation would take `false` for rank 0 and
    # "yes" for true. Not the whole model: strict Python-mode validation would refuse an enum's JSON string.
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    # Responses: unknown fields are ignored, so an operator keeps reading the state of a worker upgraded before it
    # (a newer worker may report more); the fields both know are still validated.
    model_config = ConfigDict(extra="ignore")


class SleepState(StrEnum):
    AWAKE = "awake"
    ASLEEP = "asleep"


class ResidentTag(StrEnum):
    """What `wake_up` can restore, and what `/state` reports as resident on the device."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


class DrainMode(StrEnum):
    """What happens to running requests when the worker must stop serving for a moment (sleep, weight update)."""

    DRAIN = "drain"  # hold new requests, let running ones finish (bounded by a timeout), then act
    ABORT = "abort"  # end running requests with a clear error to their clients, then act


class GroupHealth(StrEnum):
    """How a rank stands in its expert-parallel group (`/state` `group.health`)."""

    SOLO = "solo"  # no expert parallelism: world_size 1, or a model without experts; serves on its own
    WAITING = "waiting"  # loaded, no epoch applied yet (or the last one was refused): holds requests
    SERVING = "serving"  # steps with the members of the current epoch
    BROKEN = "broken"  # a collective failed or missed its deadline: keeps its requests and waits for a new epoch


ExpertMapJson = dict[str, object]  # tidal.worker.experts.ExpertMap's JSON form; the worker validates it


class GroupStatus(_Response):
    """`WorkerState.group`: the expert-parallel side of a rank."""

    health: GroupHealth
    members: list[int] = Field(
        default_factory=list, description="ranks of the current epoch, whatever its health (empty before any)"
    )
    group_size: int | None = Field(
        None, ge=1,
        description="the current epoch's group size (the start world_size before any epoch); null from a worker older "
        "than the field",
    )  # fmt: skip
    slots_per_rank: int | None = Field(
        None, ge=1,
        description="this rank's expert slots, fixed for its life: a rank that joins the group is started with the "
        "same count (--expert-slots-per-rank); null without expert parallelism",
    )  # fmt: skip
    broken_peer_rank: int | None = Field(None, description="the peer found gone or frozen, when one was found")
    broken_reason: str | None = Field(None, description="why the group broke, as the failed collective saw it")
    broken_for_s: float | None = Field(None, ge=0, description="seconds since the group broke; null unless broken")
    expert_map: ExpertMapJson | None = Field(None, description="the epoch's expert location map (JSON form)")
    held_experts: list[int | None] = Field(
        default_factory=list, description="the logical expert in each of this rank's slots (null: empty slot)"
    )
    degraded_experts: list[int] = Field(
        default_factory=list,
        description="experts no member held when the current epoch began, reloaded from the checkpoint for it",
    )
    expert_reload_s: float | None = Field(None, ge=0, description="time this rank spent loading experts this epoch")
    epoch_steps: int = Field(0, ge=0, description="group steps taken in the current epoch (empty steps included)")
    waiting_on: str | None = Field(
        None, description="why work waits although the group serves (a paused rank, two weights versions)"
    )


SleepLevel = Literal[1, 2]
Version = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$")]


class WorkerState(_Response):
    """`GET /state`."""

    sleep_state: SleepState
    sleep_level: SleepLevel | None = Field(None, description="level of the current sleep; null while awake")
    resident: list[ResidentTag] = Field(description="what currently occupies device memory")
    weights_version: str | None = Field(description="version of the weights being served; null before the first load")
    weights_source: str | None = Field(
        None,
        description="directory the served version was read from (as given at start or in /weights/update); null "
        "before the first load, for weights that came from a stream or a broadcast, and from a worker older than "
        "the field",
    )
    model_loaded: bool
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1, description="the group size this worker was started for (now: group.group_size)")
    group_epoch: int = Field(ge=0, description="membership epoch last applied by /group/reconfigure (0: never)")
    coordinator_rank: int = Field(ge=0, description="coordinator of the membership last applied (0 before any)")
    group_formed: bool = Field(
        description="a lone worker (world_size 1) always; else whether the last epoch's members are every rank of "
        "its group_size"
    )
    group: GroupStatus = Field(
        default_factory=lambda: GroupStatus(health=GroupHealth.SOLO),
        description="this rank's view of its expert-parallel group (a worker older than the field: solo)",
    )
    in_flight_requests: int = Field(ge=0, description="requests running or waiting in the engine")
    seconds_since_last_request: float | None = Field(
        None, ge=0, description="time since a request last arrived; null if none ever did (for idle sleep)"
    )


class SleepRequest(_Model):
    """`POST /sleep`."""

    level: SleepLevel = 1
    mode: DrainMode = DrainMode.DRAIN
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, strict=True)

    @field_validator("level", mode="before")
    @classmethod
    def _level_is_a_number(cls, level: object) -> object:
        # A Literal cannot be strict, and lax validation takes `true` for 1.
        if isinstance(level, bool):
            raise ValueError("level must be the number 1 or 2")
        return level


class WakeUpRequest(_Model):
    """`POST /wake_up`: restore what `tags` names, everything when omitted."""

    tags: list[ResidentTag] | None = None


class TransitionResult(_Response):
    """Answer of sleep and wake_up: the state after the call, and what it cost."""

    state: WorkerState
    duration_s: float = Field(ge=0)
    bytes_moved: int = Field(0, ge=0, description="bytes copied between host and device, or freed on the device")


class WeightsUpdateRequest(_Model):
    """`POST /weights/update`: load a checkpoint from a directory the pod can read, in place."""

    source: str = Field(min_length=1, description="local directory holding *.safetensors (sharded or not)")
    version: Version
    mode: DrainMode = DrainMode.DRAIN
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, strict=True)
    allow_extra_tensors: bool = Field(
        False, strict=True, description="accept tensors the model does not use instead of refusing"
    )


class StreamStartRequest(_Model):
    """`POST /weights/stream/start`: begin a streamed update (a newer start discards an unfinished one). Then
    `POST /weights/stream/{upload_id}/chunk?file=NAME&offset=N` with raw bytes (application/octet-stream), in order,
    for each safetensors file (and model.safetensors.index.json when sharded); then `finish`."""

    allow_extra_tensors: bool = Field(False, strict=True)


class StreamStartResponse(_Response):
    upload_id: str


class StreamChunkResult(_Response):
    upload_id: str
    file: str
    received_bytes: int = Field(ge=0, description="bytes of this file received so far: the next chunk's offset")


class StreamFinishRequest(_Model):
    """`POST /weights/stream/{upload_id}/finish`: validate everything received, then swap it in."""

    version: Version
    mode: DrainMode = DrainMode.DRAIN
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, strict=True)


class TensorSpec(_Model):
    name: str = Field(min_length=1)
    shape: list[Annotated[int, Field(ge=0, strict=True)]]
    dtype: Literal["float32", "float16", "bfloat16"]


class CollectiveUpdateRequest(_Model):
    """`POST /weights/collective`: join a process group with a trainer and receive a broadcast of named tensors."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535, strict=True)
    rank: int = Field(ge=1, strict=True, description="this worker's rank in the trainer's group; the trainer is rank 0")
    world_size: int = Field(ge=2, strict=True)
    backend: Literal["gloo", "nccl"] = "gloo"
    tensors: list[TensorSpec] = Field(min_length=1, description="what the trainer broadcasts, in order")
    allow_extra_tensors: bool = Field(False, strict=True, description="receive and drop tensors the model does not use")
    version: Version
    mode: DrainMode = DrainMode.DRAIN
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, strict=True)
    timeout_s: float = Field(300.0, gt=0, le=3600, strict=True, description="limit for joining the group and receiving")

    @model_validator(mode="after")
    def _rank_inside_group(self) -> CollectiveUpdateRequest:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")
        return self


class WeightsUpdateResult(_Response):
    version: str
    checksum: str = Field(description="overall digest of the weights now served (as GET /weights/checksum)")
    duration_s: float = Field(ge=0, description="from the call until the new weights serve (checksum not included)")
    bytes_loaded: int = Field(ge=0)
    paused_s: float = Field(0.0, ge=0, description="time new requests were held (drain or abort, then the copy)")
    checksum_s: float = Field(0.0, ge=0, description="time the checksum took, after serving resumed")


class WeightsChecksum(_Response):
    """`GET /weights/checksum`: equal digests across ranks mean they serve the same weights."""

    version: str | None
    algorithm: Literal["sha256"] = "sha256"
    overall: str = Field(description="sha256 over the sorted 'name digest' lines")
    tensors: dict[str, str] = Field(description="name -> sha256 over dtype, shape and the raw bytes (row-major)")
    covers_experts: list[int] | None = Field(
        None,
        description="expert parallelism: the logical experts this rank holds, whose tensors (with every dense one) "
        "the checksum covers; null: the whole model",
    )


class GroupMember(_Model):
    rank: int = Field(ge=0, strict=True)
    address: str = Field(min_length=1, description="host:port of the member's group endpoint")


class GroupReconfigureRequest(_Model):
    """`POST /group/reconfigure`: the membership of an expert-parallel group for one epoch.

    Every member is sent the same request. Each builds the epoch's process group through a fresh rendezvous at the
    coordinator's group endpoint, installs the epoch's expert map (loading any expert it must now hold), and only
    then steps. Without `expert_map` the coordinator plans it from the map it served last (so pick as coordinator a
    rank that was in the previous epoch) and hands it to the others through the rendezvous.

    The group's size is the epoch's (`group_size`), so a running group is resized by epochs: a shrink leaves the
    ranks at or past the new size out, a grow adds ranks started for the new size with the running members' expert
    slots per rank (`GroupStatus.slots_per_rank`), and every member must have the same slot count."""

    epoch: int = Field(ge=1, le=MAX_EPOCH, strict=True, description=f"the membership epoch, 1..{MAX_EPOCH} (int64)")
    members: list[GroupMember] = Field(min_length=1)
    coordinator_rank: int = Field(
        ge=0, strict=True, description="the member whose group endpoint hosts this epoch's rendezvous"
    )
    group_size: int | None = Field(
        None, ge=1, strict=True,
        description="ranks of the group in this epoch (every member rank is below it); null: the worker's start "
        "world_size",
    )  # fmt: skip
    expert_map: ExpertMapJson | None = Field(None, description="the epoch's map; default: the coordinator plans it")
    timeout_s: float = Field(
        60.0, gt=0, le=3600, strict=True, description="limit for the rendezvous and installing the map"
    )

    @model_validator(mode="after")
    def _members_fit(self) -> GroupReconfigureRequest:
        ranks = [m.rank for m in self.members]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks in members: {sorted(ranks)}")
        if self.coordinator_rank not in ranks:
            raise ValueError(f"coordinator_rank {self.coordinator_rank} is not one of the members {sorted(ranks)}")
        if self.group_size is not None and (outside := sorted(r for r in ranks if r >= self.group_size)):
            raise ValueError(
                f"member ranks {outside} are outside a group of group_size {self.group_size} (ranks 0.."
                f"{self.group_size - 1})"
            )
        return self


class GroupReconfigureResult(_Response):
    """Answer of `/group/reconfigure`: what was applied."""

    applied: bool = Field(description="false when this epoch was applied already with the same membership (a retry)")
    expert_map: ExpertMapJson | None = Field(None, description="the map now served; null without expert parallelism")
    loaded_experts: list[int] = Field(default_factory=list, description="experts this rank read from the checkpoint")
    duration_s: float = Field(0.0, ge=0, description="time to join the epoch and install its map")
    state: WorkerState


class ControlError(_Response):
    """Body of every non-2xx answer of the control API. A code added after the reader was built does not validate
    here; the operator's client reports such an answer with a code of its own, as it does any unreadable error."""

    code: ErrorCode = Field(description="stable machine-readable reason: one of `ErrorCode`")
    message: str
