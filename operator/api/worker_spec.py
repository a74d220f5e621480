"""`spec.worker`: the worker pods' image, compute, scheduling, environment and pod-template escape hatch."""

import re
from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from tidal.operator.api import patterns
from tidal.operator.api.base import ApiModel, CelRule, nested
from tidal.operator.api.worker_env import EXCLUSIVE_ENV_NAMES, GUARDED_ENV_NAMES, RESERVED_ENV_NAMES

LabelValue = Annotated[str, Field(max_length=63, pattern=patterns.LABEL_VALUE)]
# The most annotations a pod template may add: each key is at most 317 characters (a 253-character prefix, '/', a
# 63-character name), each value at most 4096, and a pod's annotations (Tidal's spec hash included) must stay within
# the API server's 256 KiB.
MAX_TEMPLATE_ANNOTATIONS = 56


def _is_key(key: str, pattern: str) -> bool:
    return re.search(pattern, key) is not None and re.search(patterns.QUALIFIED_NAME_PREFIX_LENGTH, key) is not None


def keys_rule(field: str, attribute: str, where: str, what: str, pattern: str = patterns.QUALIFIED_NAME) -> CelRule:
    """Every key of the map `field` (`attribute` in Python) is a label (or annotation) key, as the API server checks
    it in a pod: the structural schema can only check a map's values."""
    return CelRule(
        rule=f"!has(self.{field}) || self.{field}.all(k, k.matches('{pattern}') && "
        f"k.matches('{patterns.QUALIFIED_NAME_PREFIX_LENGTH}'))",
        message=f"{where} keys must be {what} keys: a name of at most 63 characters (letters, digits, '-', '_', '.', "
        "starting and ending with a letter or digit), optionally after a DNS subdomain prefix of at most 253 "
        "characters and '/', e.g. 'example.com/team'",
        holds=lambda m: all(_is_key(k, pattern) for k in getattr(m, attribute)),
        field_path=f".{field}",
    )


def exclusive_env_rule(first: str, second: str) -> CelRule:
    """`spec.worker.env` sets at most one of two variables the worker refuses to start with together."""
    return CelRule(
        rule=f"!has(self.env) || !(self.env.exists(e, e.name == '{first}') && "
        f"self.env.exists(e, e.name == '{second}'))",
        message=f"worker.env sets both {first} and {second}: set only one (the worker refuses to start with both)",
        holds=lambda w: not {first, second} <= {e.name for e in w.env},
        field_path=".env",
    )


# Checked on each of a pod template's volume mounts, where the API server reports the mount's own path.
TEMPLATE_MOUNT_RULE = CelRule(
    rule=f"!has(self.mountPath) || !self.mountPath.matches('{patterns.BAD_TEMPLATE_MOUNT}')",
    message="worker.podTemplate.spec mounts a volume over a system directory: a container's volumeMounts may not use "
    "/, /proc, /sys or anything below them, /dev or /etc (below /dev and /etc is fine, e.g. /dev/shm or "
    "/etc/ssl/certs), nor a path with '.' or '..' segments",
    holds=lambda mount_path: re.search(patterns.BAD_TEMPLATE_MOUNT, mount_path) is None,
    field_path=".mountPath",
)
# Where a pod template's containers mount volumes. `podTemplate.spec` stays free-form (the API server checks the pod
# when the operator creates it), but a CEL rule sees only the fields a schema declares: these, kept with their unknown
# fields. Each is nullable, as a `null` in the template removes the key in the merge. The bounds keep the rule's
# estimated cost within the API server's budget.
MAX_TEMPLATE_CONTAINERS = 32
MAX_TEMPLATE_VOLUME_MOUNTS = 64
MAX_MOUNT_PATH_LENGTH = 512
_CONTAINERS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "nullable": True,
    "maxItems": MAX_TEMPLATE_CONTAINERS,
    "items": {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "volumeMounts": {
                "type": "array",
                "nullable": True,
                "maxItems": MAX_TEMPLATE_VOLUME_MOUNTS,
                "items": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {
                        "mountPath": {"type": "string", "nullable": True, "maxLength": MAX_MOUNT_PATH_LENGTH}
                    },
                    "x-kubernetes-validations": [TEMPLATE_MOUNT_RULE.to_schema()],
                },
            }
        },
    },
}
_TEMPLATE_CONTAINER_LISTS = ("containers", "initContainers")


def _template_mount_paths(spec: dict[str, Any]) -> list[str]:
    """Every mountPath of the template's containers and init containers (malformed parts are the schema's)."""
    paths = []
    for key in _TEMPLATE_CONTAINER_LISTS:
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else []:
            mounts = container.get("volumeMounts") if isinstance(container, dict) else None
            for mount in mounts if isinstance(mounts, list) else []:
                if isinstance(mount, dict) and isinstance(mount.get("mountPath"), str):
                    paths.append(mount["mountPath"])
    return paths


class EnvVar(ApiModel):
    """An extra environment variable for the worker container."""

    name: str = Field(min_length=1, max_length=128, pattern=patterns.ENV_NAME)
    """Variable name."""
    value: str = Field("", max_length=4096)
    """Variable value."""


class Toleration(ApiModel):
    """A toleration for the worker pods (same meaning as in a Pod)."""

    key: str | None = Field(None, min_length=1, max_length=317, pattern=patterns.QUALIFIED_NAME)
    """Taint key (a label key); empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """How the key and value are compared."""
    value: str | None = Field(None, max_length=63, pattern=patterns.LABEL_VALUE)
    """Taint value to match (a label value; operator Equal only)."""
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
        CelRule(
            rule=f"!has(self.key) || self.key.matches('{patterns.QUALIFIED_NAME_PREFIX_LENGTH}')",
            message="a toleration's key must have a prefix (before '/') of at most 253 characters",
            holds=lambda t: t.key is None or re.search(patterns.QUALIFIED_NAME_PREFIX_LENGTH, t.key) is not None,
            field_path=".key",
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

    cel_rules = (
        CelRule(
            rule="!self.gpuResourceName.startsWith('requests.')",
            message="worker.resources.gpuResourceName must not start with 'requests.': the API server refuses such "
            "an extended resource name",
            holds=lambda r: not r.gpu_resource_name.startswith("requests."),
            field_path=".gpuResourceName",
        ),
    )


class PodTemplateMetadata(ApiModel):
    """Extra labels and annotations for the worker pods."""

    labels: dict[str, LabelValue] = Field(default_factory=dict, max_length=64)
    """Labels added to each worker pod (Tidal's own labels win on conflict); keys and values as in any label."""
    annotations: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=MAX_TEMPLATE_ANNOTATIONS
    )
    """Annotations added to each worker pod; at most 56, so that a pod's annotations fit in the API server's 256 KiB."""

    cel_rules = (
        keys_rule("labels", "labels", "worker.podTemplate.metadata.labels", "label"),
        keys_rule(
            "annotations",
            "annotations",
            "worker.podTemplate.metadata.annotations",
            "annotation",
            patterns.ANNOTATION_KEY,
        ),
    )


class PodTemplate(ApiModel):
    """Escape hatch: merged into every worker pod. See docs/API.md, "Pod template merge", for the exact rule."""

    metadata: PodTemplateMetadata = nested(PodTemplateMetadata)
    """Extra pod labels and annotations."""
    spec: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra={
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {key: _CONTAINERS_SCHEMA for key in _TEMPLATE_CONTAINER_LISTS},
        },
    )
    """A partial PodSpec merged over the one Tidal builds (the API server checks the pod). Only where containers
    mount volumes is checked here: not over a system directory (/, /proc, /sys, /dev, /etc)."""

    @model_validator(mode="after")
    def _check_mount_paths(self) -> Self:
        # The Python twin of TEMPLATE_MOUNT_RULE, which the schema puts on each volume mount.
        if not all(TEMPLATE_MOUNT_RULE.holds(path) for path in _template_mount_paths(self.spec)):
            raise ValueError(TEMPLATE_MOUNT_RULE.message)
        return self


class WorkerSpec(ApiModel):
    """The worker pods: one per rank, running `tidal-worker`."""

    image: str = Field("ghcr.io/tidal-dev/tidal-worker:0.1.0", min_length=1, max_length=512, pattern=patterns.TRIMMED)
    """Worker container image, without whitespace at either end. (The local dev cluster runs the command on the
    host and ignores it.)"""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""
    resources: WorkerResources = nested(WorkerResources)
    """GPUs, CPU and memory per rank."""
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32)
    """Node labels the worker pods require; keys and values as in any label."""
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
        CelRule(
            rule="!has(self.env) || self.env.all(e, !(e.name in " + repr(list(GUARDED_ENV_NAMES)) + "))",
            message="worker.env must not set "
            + ", ".join(GUARDED_ENV_NAMES)
            + ": the operator reaches each worker's control API on the pod's IP with the token it sets in "
            + "TIDAL_CONTROL_TOKEN (with a token file as well, the worker refuses to start)",
            holds=lambda w: all(e.name not in GUARDED_ENV_NAMES for e in w.env),
            field_path=".env",
        ),
        *(exclusive_env_rule(first, second) for first, second in EXCLUSIVE_ENV_NAMES),
        keys_rule("nodeSelector", "node_selector", "worker.nodeSelector", "label"),
    )
