"""One worker pod per rank: `<model>-r<replica>-<rank>`, running `tidal-worker --model ... --port ...`."""

from typing import Any

from tidal.operator.api import worker_env as env
from tidal.operator.api.constants import GROUP_PORT, LABEL_LEADER, LABEL_SERVING
from tidal.operator.api.resource import InferenceModel
from tidal.operator.api.spec import InferenceModelSpec, ModelVolume
from tidal.operator.builders import names
from tidal.operator.builders.merge import (
    CONTROL_PORT_NAME,
    GROUP_PORT_NAME,
    SERVE_PORT_NAME,
    WORKER_CONTAINER,
    apply_pod_template,
)
from tidal.operator.builders.owner import object_meta, stamp_hash
from tidal.operator.builders.weights import Weights, desired_weights, model_dir, mount_path

MODEL_VOLUME = "model"
# Labels the operator moves on a live pod; they describe the pod's role now, not what it was built from.
MUTABLE_LABELS = frozenset({LABEL_LEADER, LABEL_SERVING})
# Kubernetes' default path of a container's termination message. The worker writes its fatal error there (told by
# TIDAL_TERMINATION_MESSAGE_PATH); a worker that dies without writing (killed, or a crash before it could) still
# leaves the tail of its log, which is what the policy adds.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_POLICY = "FallbackToLogsOnError"
# Pods built before these settings existed are not outdated for lacking them (upgrading the operator replaces no
# pod); a pod template's other choice of policy counts as usual.
_UNHASHED_WHEN_DEFAULT = {"terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": TERMINATION_POLICY}


def _value(name: str, value: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def serving_at_creation(spec: InferenceModelSpec) -> bool:
    """A lone rank serves as soon as it is ready. A rank of a group serves only once the operator has seen it step
    in its group's epoch (until then its answers would wait on peers that may not be there), so it starts out."""
    return not spec.is_expert_parallel


def _group_env(spec: InferenceModelSpec, slots_per_rank: int | None) -> list[dict[str, Any]]:
    experts = spec.experts
    out = [
        {"name": env.GROUP_HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _value(env.GROUP_PORT, GROUP_PORT),
        _value(env.GROUP_TIMEOUT_S, str(float(experts.collective_timeout_seconds))),
        _value(env.REDUNDANT_EXPERTS_PER_RANK, experts.redundant_experts_per_rank),
    ]
    if slots_per_rank is not None:
        out.append(_value(env.EXPERT_SLOTS_PER_RANK, slots_per_rank))
    return out


def worker_env(
    model: InferenceModel, replica: int, rank: int, slots_per_rank: int | None = None, weights: Weights | None = None
) -> list[dict[str, Any]]:
    """`weights`: what the worker loads at start (see `build_pod`)."""
    spec = model.spec
    name = model.metadata.name
    start = weights if weights is not None else desired_weights(spec)
    if start.source is None:
        raise ValueError(f"a pod cannot start on weights {start.version} without knowing their directory")
    out = [
        _value(env.MODEL, model_dir(spec)),
        _value(env.PORT, spec.serving.port),
        {"name": env.HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _value(env.SERVED_MODEL_NAME, spec.model.served_name or name),
        _value(env.DTYPE, spec.model.dtype),
        _value(env.CONTROL_PORT, spec.serving.control_port),
        {
            "name": env.CONTROL_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": names.token_secret_name(name), "key": names.TOKEN_SECRET_KEY}},
        },
        _value(env.WEIGHTS_PATH, start.source),
        _value(env.WEIGHTS_VERSION, start.version),
        _value(env.REPLICA, replica),
        _value(env.RANK, rank),
        _value(env.WORLD_SIZE, spec.expert_parallel),
        {"name": env.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        _value(env.GROUP_SERVICE, names.group_service_name(name)),
        _value(env.TERMINATION_MESSAGE_PATH, TERMINATION_LOG),
    ]
    if spec.model.max_model_len is not None:
        out.insert(5, _value(env.MAX_MODEL_LEN, spec.model.max_model_len))
    # Set only when asked for, so that a pod of a model that does not ask keeps the spec hash it had before the field.
    if spec.model.kv_cache_dtype != "auto":
        out.insert(5, _value(env.KV_CACHE_DTYPE, spec.model.kv_cache_dtype))
    if spec.model.weight_dtype != "auto":
        out.insert(5, _value(env.WEIGHT_DTYPE, spec.model.weight_dtype))
    # Only groups get the group's settings: a pod of expertParallel 1 stays exactly as it was before groups existed
    # (same spec hash, so upgrading the operator replaces no pod), and its worker would ignore them anyway.
    if spec.is_expert_parallel:
        out += _group_env(spec, slots_per_rank)
    return out + [{"name": e.name, "value": e.value} for e in spec.worker.env]


def _resources(spec: InferenceModelSpec) -> dict[str, Any]:
    res = spec.worker.resources
    amounts: dict[str, str] = {}
    if res.cpu is not None:
        amounts["cpu"] = res.cpu
    if res.memory is not None:
        amounts["memory"] = res.memory
    if res.gpus_per_rank > 0:
        amounts[res.gpu_resource_name] = str(res.gpus_per_rank)
    # Requests equal limits: GPUs must anyway, and equal CPU/memory keeps a rank from being squeezed mid-batch.
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _volume(volume: ModelVolume) -> dict[str, Any]:
    if volume.host_path is not None:
        return {"name": MODEL_VOLUME, "hostPath": {"path": volume.host_path.path, "type": "Directory"}}
    if volume.persistent_volume_claim is None:
        raise ValueError("model.volume needs exactly one of persistentVolumeClaim or hostPath")
    claim = volume.persistent_volume_claim.claim_name
    return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "serve"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _ports(spec: InferenceModelSpec) -> list[dict[str, Any]]:
    ports = [
        {"name": SERVE_PORT_NAME, "containerPort": spec.serving.port, "protocol": "TCP"},
        {"name": CONTROL_PORT_NAME, "containerPort": spec.serving.control_port, "protocol": "TCP"},
    ]
    if spec.is_expert_parallel:
        ports.append({"name": GROUP_PORT_NAME, "containerPort": GROUP_PORT, "protocol": "TCP"})
    return ports


def _container(
    model: InferenceModel, replica: int, rank: int, slots_per_rank: int | None, weights: Weights | None
) -> dict[str, Any]:
    spec = model.spec
    return {
        "name": WORKER_CONTAINER,
        "image": spec.worker.image,
        "imagePullPolicy": spec.worker.image_pull_policy,
        "command": ["tidal-worker", "--model", model_dir(spec), "--port", str(spec.serving.port)],
        "env": worker_env(model, replica, rank, slots_per_rank, weights),
        "ports": _ports(spec),
        "resources": _resources(spec),
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": mount_path(spec.model.volume), "readOnly": True}],
        # Loading a large model can take many minutes (up to 30 here); liveness only starts once /health answered.
        # A short period lets a small model count as started within a couple of seconds of being loaded.
        "startupProbe": _probe("/health", period=2, failures=900),
        "livenessProbe": _probe("/health", period=10, failures=6),
        "readinessProbe": _probe("/ready", period=5, failures=3),
        "securityContext": {"allowPrivilegeEscalation": False},
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": TERMINATION_POLICY,
    }


def spec_identity(pod: dict[str, Any]) -> dict[str, Any]:
    """What makes a pod outdated when it changes: everything except in-place weights, a group rank's shape (resized
    by epochs), the labels the operator moves on live pods (the serving label flips with the group's epochs;
    flipping it must never replace a pod) and the termination message settings at their defaults."""
    spec = pod["spec"]
    containers = []
    for c in spec["containers"]:
        names_ = {e["name"] for e in c.get("env") or []}
        group_shape = env.GROUP_SHAPE_ENV_NAMES if env.GROUP_HOST in names_ else frozenset()
        unhashed = env.IN_PLACE_ENV_NAMES | {env.TERMINATION_MESSAGE_PATH} | group_shape
        kept = [e for e in c.get("env") or [] if e["name"] not in unhashed]
        fields = {k: v for k, v in c.items() if _UNHASHED_WHEN_DEFAULT.get(k) != v}
        containers.append({**fields, "env": kept})
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k not in MUTABLE_LABELS}
    annotations = pod["metadata"].get("annotations", {})
    return {"spec": {**spec, "containers": containers}, "labels": labels, "annotations": annotations}


def build_pod(
    model: InferenceModel,
    replica: int,
    rank: int,
    slots_per_rank: int | None = None,
    weights: Weights | None = None,
) -> dict[str, Any]:
    """The rank's pod. `slots_per_rank`: the expert slots the replica's running members hold (expert parallelism,
    when any runs), which a rank created later must match. `weights`: what the worker loads at start, which the
    planner chooses (`planner/weights.py`: the spec's, or the last that served after a roll to the spec's failed);
    None: the spec's own. Neither enters the spec hash."""
    name = model.metadata.name
    pod_name = names.pod_name(name, replica, rank)
    labels = names.pod_labels(name, replica, rank, leader=rank == 0, serving=serving_at_creation(model.spec))
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": object_meta(model, pod_name, labels),
        "spec": {
            "hostname": pod_name,
            "subdomain": names.group_service_name(name),
            "restartPolicy": "Always",
            # Workers never call the Kubernetes API; they get no credentials for it.
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 30,
            "containers": [_container(model, replica, rank, slots_per_rank, weights)],
            "volumes": [_volume(model.spec.model.volume)],
        },
    }
    worker = model.spec.worker
    if worker.node_selector:
        pod["spec"]["nodeSelector"] = dict(worker.node_selector)
    if worker.tolerations:
        pod["spec"]["tolerations"] = [t.model_dump(exclude_none=True) for t in worker.tolerations]
    if worker.pod_template is not None:
        meta = worker.pod_template.metadata
        pod = apply_pod_template(pod, worker.pod_template.spec, meta.labels, meta.annotations)
    return stamp_hash(pod, spec_identity(pod))
