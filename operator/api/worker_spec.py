"""`spec.worker`: the worker pods' image, compute, scheduling, environment and pod-template escape hatch."""

from typing import Annotated, Any, Literal

from pydantic import Field

from tidal.operator.api import patterns
from tidal.operator.api.base import ApiModel, CelRule, nested
from tidal.operator.api.worker_env import RESERVED_ENV_NAMES

LabelValue = Annotated[str, Field(max_length=63)]


class EnvVar(ApiModel):
    """An extra environment variable for the worker container."""

    name: str = Field(min_length=1, max_length=128, pattern=patterns.ENV_NAME)
    """Variable name."""
    value: str = Field("", max_length=4096)
    """Variable value."""


class Toleration(ApiModel):
    """A toleration for the worker pods (same meaning as in a Pod)."""

    key: str | None = Field(None, min_length=1, max_length=316)
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """How the key and value are compared."""
    value: str | None = Field(None, max_length=63)
    """Taint value to match (operator Equal only)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = Field(None, ge=0, le=31536000)
    """How long a NoExecute taint is tolerated before eviction."""

    cel_rules = (
        CelRule(
            rule="self.operator == 'Exists' || has(self.key)",
            message="a toleration without a key must use operator Exists",
            holds=lambda t: t.operator == "Exists" or t.key is not None,
        ),
        CelRule(
            rule="!(self.operator == 'Exists' && has(self.value))",
            message="a toleration with operator Exists must not set value",
            holds=lambda t: not (t.operator == "Exists" and t.value is not None),
        ),
        CelRule(
            rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerationSeconds only applies to effect NoExecute",
            holds=lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        ),
    )


class WorkerResources(ApiModel):
    """Compute for each rank's pod (requests equal limits, so pods get a predictable share)."""

    gpus_per_rank: int = Field(0, ge=0, le=16)
    """GPUs for each rank's pod; 0 runs on CPU."""
    gpu_resource_name: str = Field("nvidia.com/gpu", max_length=253, pattern=patterns.RESOURCE_NAME)
    """Extended resource that counts GPUs on the nodes."""
    cpu: str | None = Field(None, max_length=32, pattern=patterns.QUANTITY)
    """CPU for each rank's pod, e.g. `4` or `500m`."""
    memory: str | None = Field(None, max_length=32, pattern=patterns.QUANTITY)
    """Memory for each rank's pod, e.g. `32Gi`."""


class PodTemplateMetadata(ApiModel):
    """Extra labels and annotations for the worker pods."""

    labels: dict[str, LabelValue] = Field(default_factory=dict, max_length=64)
    """Labels added to each worker pod (Tidal's own labels win on conflict)."""
    annotations: dict[str, Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict, max_length=64)
    """Annotations added to each worker pod."""


class PodTemplate(ApiModel):
    """Escape hatch: merged into every worker pod. See docs/API.md, "Pod template merge", for the exact rule."""

    metadata: PodTemplateMetadata = nested(PodTemplateMetadata)
    """Extra pod labels and annotations."""
    spec: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    """A partial PodSpec merged over the one Tidal builds (not validated here; the API server checks the pod)."""


class WorkerSpec(ApiModel):
    """The worker pods: one per rank, running `tidal-worker`."""

    image: str = Field("ghcr.io/tidal-dev/tidal-worker:0.1.0", min_length=1, max_length=512)
    """Worker container image. (The local dev cluster runs the command on the host and ignores it.)"""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""
    resources: WorkerResources = nested(WorkerResources)
    """GPUs, CPU and memory per rank."""
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32)
    """Node labels the worker pods require."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the worker pods tolerate."""
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    """Extra environment for the worker (TIDAL_* tunables of the worker CLI, or anything else). The variables Tidal
    derives from this spec are reserved."""
    pod_template: PodTemplate | None = None
    """Escape hatch merged into every worker pod."""

    cel_rules = (
        CelRule(
            rule="!has(self.env) || self.env.all(e, !(e.name in " + repr(list(RESERVED_ENV_NAMES)) + "))",
            message="worker.env must not set "
            + ", ".join(RESERVED_ENV_NAMES)
            + ": Tidal derives them from the spec (set the matching spec field instead)",
            holds=lambda w: all(e.name not in RESERVED_ENV_NAMES for e in w.env),
            field_path=".env",
        ),
        CelRule(
            rule="!has(self.env) || self.env.all(e, self.env.exists_one(f, f.name == e.name))",
            message="worker.env has the same variable name twice",
            holds=lambda w: len({e.name for e in w.env}) == len(w.env),
            field_path=".env",
        ),
    )
