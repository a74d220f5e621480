"""`InferenceModel.spec`: what the user asks for; the CRD schema, docs table and validation all come from here."""

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from tidal.operator.api import patterns
from tidal.operator.api.base import ApiModel, CelRule, nested
from tidal.operator.api.constants import BASE_WEIGHTS_VERSION, GROUP_PORT
from tidal.operator.api.worker_spec import WorkerSpec

Dtype = Literal["auto", "float16", "bfloat16", "float32"]
# The worker's `EngineConfig.kv_cache_dtype` names (a test keeps them equal; the operator imports no worker code).
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
# The worker's `EngineConfig.weight_dtype` names (a test keeps them equal; the operator imports no worker code).
WeightDtype = Literal["auto", "fp8"]


def _not_bool(value: Any) -> Any:
    # Python's True == 1 lets a bool through Literal[1, 2]; JSON (and the API server) say a bool is not an integer.
    if isinstance(value, bool):
        raise ValueError("Input should be 1 or 2, not a boolean")
    return value


SleepLevel = Annotated[Literal[1, 2], BeforeValidator(_not_bool)]


def _no_parent_segment(path: str) -> bool:
    return re.search(patterns.PARENT_SEGMENT, path) is None


DEFAULT_PVC_MOUNT = "/models"


class PersistentVolumeClaimVolume(ApiModel):
    """A PersistentVolumeClaim in the model's namespace that holds the model files."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=patterns.DNS_SUBDOMAIN)
    """Name of the PersistentVolumeClaim."""


class HostPathVolume(ApiModel):
    """A directory on the node. On the local dev cluster pods run as host processes, so this is the host filesystem."""

    path: str = Field(min_length=1, max_length=1024, pattern=patterns.ABSOLUTE_PATH)
    """Absolute directory on the node, without '..' segments."""

    cel_rules = (
        CelRule(
            rule=f"!self.path.matches('{patterns.PARENT_SEGMENT}')",
            message="model.volume.hostPath.path must not contain '..' segments: Kubernetes refuses them in a pod's "
            "hostPath",
            holds=lambda h: _no_parent_segment(h.path),
            field_path=".path",
        ),
    )


class ModelVolume(ApiModel):
    """The volume the worker pods mount read-only to find the model (exactly one source)."""

    persistent_volume_claim: PersistentVolumeClaimVolume | None = None
    """Mount this PersistentVolumeClaim."""
    host_path: HostPathVolume | None = None
    """Mount this node directory."""
    mount_path: str | None = Field(None, min_length=1, max_length=1024, pattern=patterns.ABSOLUTE_PATH)
    """Where the volume appears in the pod. Default: the hostPath's own path (so paths read the same on the node and
    in the pod), or /models for a PersistentVolumeClaim."""

    cel_rules = (
        CelRule(
            rule="has(self.persistentVolumeClaim) != has(self.hostPath)",
            message="model.volume needs exactly one of persistentVolumeClaim or hostPath",
            holds=lambda v: (v.persistent_volume_claim is None) != (v.host_path is None),
        ),
        CelRule(
            rule=f"has(self.mountPath) ? !self.mountPath.matches('{patterns.ROOT_PATH}') : "
            f"!(has(self.hostPath) && self.hostPath.path.matches('{patterns.ROOT_PATH}'))",
            message="model.volume would be mounted at /, over the worker container's own files: set mountPath to "
            "another directory",
            holds=lambda v: re.search(patterns.ROOT_PATH, v.mounted_at()) is None,
            field_path=".mountPath",
        ),
        CelRule(
            rule=f"has(self.mountPath) ? !self.mountPath.matches('{patterns.SYSTEM_DIR}') : "
            f"!(has(self.hostPath) && self.hostPath.path.matches('{patterns.SYSTEM_DIR}'))",
            message="model.volume would be mounted over a system directory (/proc, /sys or anything below them, /dev "
            "or /etc), which breaks the worker container: set mountPath to another directory",
            holds=lambda v: re.search(patterns.SYSTEM_DIR, v.mounted_at()) is None,
            field_path=".mountPath",
        ),
    )

    def mounted_at(self) -> str:
        """Where the volume appears in the pod (the builders mount it there; the root-mount rule checks it)."""
        if self.mount_path is not None:
            return self.mount_path
        if self.host_path is not None:
            return self.host_path.path
        return DEFAULT_PVC_MOUNT


class ModelSource(ApiModel):
    """Where the model is and how to load it."""

    volume: ModelVolume
    """The volume that holds the model."""
    path: str = Field(min_length=1, max_length=1024, pattern=patterns.RELATIVE_PATH)
    """Directory of the model (config.json, tokenizer, safetensors) relative to the volume, e.g. `qwen3-0.6b`."""
    dtype: Dtype = "auto"
    """Data type of the weights on the device; `auto` takes the checkpoint's."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """Element type of the KV cache: `auto` is the activations' dtype; `fp8` (or `fp8_e4m3`) stores K and V as FP8
    e4m3 without a scale: twice the tokens in the same memory and half the bytes decode attention reads, for a
    small loss of precision (3 mantissa bits)."""
    weight_dtype: WeightDtype = "auto"
    """Element type of the projections' and MoE experts' weights: `auto` keeps the model dtype; `fp8` serves them as
    FP8 e4m3 with a scale per output channel, quantized as the checkpoint is read (the FP8 GEMMs of large batches
    quantize the activations per token; the expert kernels widen the weights to 16 bits): half the weight bytes and,
    for the projections, twice the tensor-core rate, for some precision. Needs GPUs of compute capability 8.9 or
    newer (Ada, Hopper). Embeddings, LM head, norms and the MoE router keep the model dtype."""
    max_model_len: int | None = Field(None, ge=16, le=1048576)
    """Longest sequence (prompt + output) in tokens. Default: the model's own limit."""
    served_name: str | None = Field(None, min_length=1, max_length=253)
    """Model name clients send in OpenAI requests. Default: the object's name."""

    cel_rules = (
        CelRule(
            rule=f"!self.path.matches('{patterns.PARENT_SEGMENT}')",
            message="model.path must stay inside the volume: '..' segments are not allowed",
            holds=lambda m: _no_parent_segment(m.path),
            field_path=".path",
        ),
    )


class ServingSpec(ApiModel):
    """Ports of each worker: the OpenAI-compatible API and the operator-only control API."""

    port: int = Field(8000, ge=1024, le=65535)
    """Port of the OpenAI-compatible API, /health and /ready (also the Service's port). Unprivileged (>= 1024)."""
    control_port: int = Field(8001, ge=1024, le=65535)
    """Port of the control API (sleep, wake, weights); a NetworkPolicy lets only the operator reach it."""

    cel_rules = (
        CelRule(
            rule="self.port != self.controlPort",
            message="serving.port and serving.controlPort must differ",
            holds=lambda s: s.port != s.control_port,
        ),
    )


class SleepSpec(ApiModel):
    """Sleep frees the GPU without deleting pods; waking is much faster than a cold start."""

    state: Literal["Awake", "Asleep"] = "Awake"
    """Desired state of every rank."""
    level: SleepLevel = 1
    """1: weights kept in host memory (fast wake); 2: weights dropped and reloaded from the volume on wake."""
    idle_timeout_seconds: int | None = Field(None, ge=60, le=604800)
    """While state is Awake, put the model to sleep after this long without requests; a request wakes it."""


class WeightsSpec(ApiModel):
    """Weights to serve. Changing them rolls the new weights into the running pods in place (no restart)."""

    version: str = Field(min_length=1, max_length=63, pattern=patterns.WEIGHTS_VERSION)
    """Label of these weights, shown in status; a new version triggers the roll."""
    source: str = Field(min_length=1, max_length=1024, pattern=patterns.RELATIVE_PATH)
    """Directory of the safetensors files relative to the model volume; they must fit the model's architecture."""

    cel_rules = (
        CelRule(
            rule=f"self.version != '{BASE_WEIGHTS_VERSION}'",
            message=f"weights.version '{BASE_WEIGHTS_VERSION}' is reserved for the weights in model.path",
            holds=lambda w: w.version != BASE_WEIGHTS_VERSION,
            field_path=".version",
        ),
        CelRule(
            rule=f"!self.source.matches('{patterns.PARENT_SEGMENT}')",
            message="weights.source must stay inside the volume: '..' segments are not allowed",
            holds=lambda w: _no_parent_segment(w.source),
            field_path=".source",
        ),
    )


class UpdateStrategy(ApiModel):
    """How weight rolls and pod replacements proceed."""

    max_unavailable: int = Field(1, ge=1, le=64)
    """Most replicas being updated or not ready at once during a roll."""


class ExpertsSpec(ApiModel):
    """How the ranks of an expert-parallel group share the experts. Read by each rank's worker at start, so with
    expertParallel above 1 a change replaces the pods; with expertParallel 1 they are accepted and unused."""

    redundant_experts_per_rank: int = Field(0, ge=0, le=256)
    """Expert slots on each rank beyond an even share (ceil(experts / expertParallel)); they hold extra copies of
    experts, so a group that loses a rank has fewer experts (or none) to reload before its survivors serve again, at
    the cost of device memory for the copies. Used only when expertParallel is above 1."""
    collective_timeout_seconds: float = Field(10.0, gt=0, le=600)
    """Deadline of one exchange between the ranks of a group: a rank that has not answered by then (crashed or frozen)
    breaks the group's step, and the operator forms a new epoch without it. Shorter finds a frozen rank sooner; too
    short breaks a healthy group on a slow step. Used only when expertParallel is above 1."""


def _group_port_free(spec: "InferenceModelSpec") -> bool:
    return not spec.is_expert_parallel or GROUP_PORT not in (spec.serving.port, spec.serving.control_port)


class InferenceModelSpec(ApiModel):
    """Desired state of an InferenceModel."""

    model: ModelSource
    """The model to serve."""
    worker: WorkerSpec = nested(WorkerSpec)
    """The worker pods."""
    replicas: int = Field(1, ge=0, le=64)
    """Independent copies of the model behind the Service; 0 keeps the object but runs no pods."""
    expert_parallel: int = Field(1, ge=1, le=64)
    """Ranks (pods) per replica that share the experts of a mixture-of-experts model; 1 runs each replica as one
    pod. Above 1, every rank is a full serving endpoint and the Service sends requests to each rank that serves in
    its group's current epoch. Changing it between values above 1 resizes each group by epochs: the ranks that stay
    keep running and serving (the new group must still hold every expert in the slots its ranks have); changing it
    to or from 1 replaces the pods."""
    experts: ExpertsSpec = nested(ExpertsSpec)
    """Expert parallelism: redundant expert copies and the group's deadline."""
    serving: ServingSpec = nested(ServingSpec)
    """Ports."""
    sleep: SleepSpec = nested(SleepSpec)
    """Sleep and wake."""
    weights: WeightsSpec | None = None
    """Weights to serve instead of those in model.path (version `base`)."""
    update_strategy: UpdateStrategy = nested(UpdateStrategy)
    """Pace of weight rolls."""

    @property
    def is_expert_parallel(self) -> bool:
        """Each replica is a group of ranks that share the experts (and talk to each other)."""
        return self.expert_parallel > 1

    cel_rules = (
        CelRule(
            rule=f"self.expertParallel == 1 || !({GROUP_PORT} in [self.serving.port, self.serving.controlPort])",
            message=f"serving.port and serving.controlPort must not be {GROUP_PORT} when expertParallel is above 1: "
            f"the ranks of a group reach each other on port {GROUP_PORT}",
            holds=_group_port_free,
            field_path=".serving",
        ),
    )
