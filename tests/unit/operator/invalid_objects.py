"""Table of InferenceModel objects that must be refused, shared by the unit tests (pydantic model and the generated
schema) and the e2e tests (the real API server). Each case changes a valid object at dotted paths.

`pydantic_error` is a substring of str(ValidationError); `apiserver_error` a substring of the API server's answer
(what `kubectl create -f` prints on stderr; every case was checked against kube-apiserver v1.36.3 with the generated
CRD); `field` is the path the API server names (every rule names one: kubectl prints a rule without a path as
"<nil>: Invalid value").

From another test folder (pytest puts each test folder without __init__.py on sys.path, so insert this one):

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "operator"))
    from invalid_objects import CASES, VALID
"""

import copy
from dataclasses import dataclass
from typing import Any

DELETE = object()  # marks a path to remove

VALID: dict[str, Any] = {
    "apiVersion": "tidal.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "tiny", "namespace": "default"},
    "spec": {"model": {"volume": {"hostPath": {"path": "/srv/models"}}, "path": "tiny-llama"}},
}


@dataclass(frozen=True)
class InvalidCase:
    id: str
    why: str
    changes: dict[str, Any]
    pydantic_error: str
    apiserver_error: str
    field: str

    def build(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = copy.deepcopy(base if base is not None else VALID)
        for path, value in self.changes.items():
            *parents, last = path.split(".")
            node = obj
            for key in parents:
                node = node.setdefault(key, {})
            if value is DELETE:
                node.pop(last, None)
            else:
                node[last] = copy.deepcopy(value)
        return obj


def _env(*names: str) -> list[dict[str, str]]:
    return [{"name": n, "value": "1"} for n in names]


def _template_mount(path: str, key: str = "containers", container: str = "worker") -> dict[str, Any]:
    """A pod template that mounts an emptyDir at `path` in `container` (of `containers` or `initContainers`)."""
    return {
        "spec": {
            key: [{"name": container, "volumeMounts": [{"name": "scratch", "mountPath": path}]}],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        }
    }


CASES: list[InvalidCase] = [
    InvalidCase(
        "bad-dtype",
        "dtype is an enum",
        {"spec.model.dtype": "fp8"},
        "Input should be 'auto', 'float16', 'bfloat16' or 'float32'",
        'Unsupported value: "fp8"',
        "spec.model.dtype",
    ),
    InvalidCase(
        "bad-kv-cache-dtype",
        "the KV cache's dtype is an enum",
        {"spec.model.kvCacheDtype": "int8"},
        "Input should be 'auto', 'fp8' or 'fp8_e4m3'",
        'Unsupported value: "int8"',
        "spec.model.kvCacheDtype",
    ),
    InvalidCase(
        "bad-weight-dtype",
        "the weights' dtype is an enum",
        {"spec.model.weightDtype": "int4"},
        "Input should be 'auto' or 'fp8'",
        'Unsupported value: "int4"',
        "spec.model.weightDtype",
    ),
    InvalidCase(
        "negative-replicas",
        "replicas cannot be negative",
        {"spec.replicas": -1},
        "greater than or equal to 0",
        "greater than or equal to 0",
        "spec.replicas",
    ),
    InvalidCase(
        "replicas-as-string",
        "numbers are numbers, not strings",
        {"spec.replicas": "2"},
        "Input should be a valid integer",
        "must be of type integer",
        "spec.replicas",
    ),
    InvalidCase(
        "missing-model",
        "the model source is required",
        {"spec.model": DELETE},
        "Field required",
        "Required value",
        "spec.model",
    ),
    InvalidCase(
        "volume-without-source",
        "a volume needs a PVC or a hostPath",
        {"spec.model.volume": {}},
        "model.volume needs exactly one of persistentVolumeClaim or hostPath",
        "model.volume needs exactly one of persistentVolumeClaim or hostPath",
        "spec.model.volume",
    ),
    InvalidCase(
        "volume-with-two-sources",
        "PVC and hostPath conflict",
        {"spec.model.volume": {"hostPath": {"path": "/srv/models"}, "persistentVolumeClaim": {"claimName": "models"}}},
        "model.volume needs exactly one of persistentVolumeClaim or hostPath",
        "model.volume needs exactly one of persistentVolumeClaim or hostPath",
        "spec.model.volume",
    ),
    InvalidCase(
        "expert-parallel-above-64",
        "a readable upper bound on the ranks of one replica",
        {"spec.expertParallel": 65},
        "less than or equal to 64",
        "less than or equal to 64",
        "spec.expertParallel",
    ),
    InvalidCase(
        "group-port-as-serving-port",
        "ranks of a group reach each other on port 7100",
        {"spec.expertParallel": 2, "spec.serving": {"port": 7100}},
        "serving.port and serving.controlPort must not be 7100 when expertParallel is above 1",
        "serving.port and serving.controlPort must not be 7100 when expertParallel is above 1",
        "spec.serving",
    ),
    InvalidCase(
        "group-port-as-control-port",
        "ranks of a group reach each other on port 7100",
        {"spec.expertParallel": 4, "spec.serving": {"controlPort": 7100}},
        "serving.port and serving.controlPort must not be 7100 when expertParallel is above 1",
        "serving.port and serving.controlPort must not be 7100 when expertParallel is above 1",
        "spec.serving",
    ),
    InvalidCase(
        "negative-redundant-experts",
        "a rank cannot hold fewer than no extra slots",
        {"spec.experts": {"redundantExpertsPerRank": -1}},
        "greater than or equal to 0",
        "greater than or equal to 0",
        "spec.experts.redundantExpertsPerRank",
    ),
    InvalidCase(
        "collective-timeout-zero",
        "a deadline of 0 s would break every step",
        {"spec.experts": {"collectiveTimeoutSeconds": 0}},
        "Input should be greater than 0",
        "should be greater than 0",
        "spec.experts.collectiveTimeoutSeconds",
    ),
    InvalidCase(
        "collective-timeout-as-string",
        "seconds are a number",
        {"spec.experts": {"collectiveTimeoutSeconds": "10s"}},
        "Input should be a valid number",
        "must be of type number",
        "spec.experts.collectiveTimeoutSeconds",
    ),
    InvalidCase(
        "reserved-group-env",
        "the group port is Tidal's",
        {"spec.worker": {"env": _env("TIDAL_GROUP_PORT")}},
        "worker.env must not set",
        "worker.env must not set",
        "spec.worker.env",
    ),
    InvalidCase(
        "expert-parallel-zero",
        "a replica has at least one rank",
        {"spec.expertParallel": 0},
        "greater than or equal to 1",
        "greater than or equal to 1",
        "spec.expertParallel",
    ),
    InvalidCase(
        "expert-parallel-negative",
        "a replica has at least one rank, and expert parallelism is supported above 1",
        {"spec.expertParallel": -2},
        "greater than or equal to 1",
        "greater than or equal to 1",
        "spec.expertParallel",
    ),
    InvalidCase(
        "same-ports",
        "serving and control ports conflict",
        {"spec.serving": {"port": 9000, "controlPort": 9000}},
        "serving.port and serving.controlPort must differ",
        "serving.port and serving.controlPort must differ",
        "spec.serving",
    ),
    InvalidCase(
        "privileged-port",
        "workers run unprivileged",
        {"spec.serving": {"port": 80}},
        "greater than or equal to 1024",
        "greater than or equal to 1024",
        "spec.serving.port",
    ),
    InvalidCase(
        "bad-sleep-state",
        "sleep.state is an enum",
        {"spec.sleep": {"state": "Sleepy"}},
        "Input should be 'Awake' or 'Asleep'",
        'Unsupported value: "Sleepy"',
        "spec.sleep.state",
    ),
    InvalidCase(
        "sleep-level-three",
        "only levels 1 and 2 exist",
        {"spec.sleep": {"level": 3}},
        "Input should be 1 or 2",
        "Unsupported value: 3",
        "spec.sleep.level",
    ),
    InvalidCase(
        "idle-timeout-too-short",
        "sleeping after seconds would thrash",
        {"spec.sleep": {"idleTimeoutSeconds": 10}},
        "greater than or equal to 60",
        "greater than or equal to 60",
        "spec.sleep.idleTimeoutSeconds",
    ),
    InvalidCase(
        "reserved-env",
        "TIDAL_RANK is derived from the spec",
        {"spec.worker": {"env": _env("TIDAL_RANK")}},
        "worker.env must not set",
        "worker.env must not set",
        "spec.worker.env",
    ),
    InvalidCase(
        "duplicate-env",
        "one name, one value",
        {"spec.worker": {"env": _env("HF_HOME", "HF_HOME")}},
        "worker.env has the same variable name twice",
        "worker.env has the same variable name twice",
        "spec.worker.env",
    ),
    InvalidCase(
        "weights-version-base",
        "'base' names the weights in model.path",
        {"spec.weights": {"version": "base", "source": "ckpt"}},
        "weights.version 'base' is reserved",
        "weights.version 'base' is reserved",
        "spec.weights.version",
    ),
    InvalidCase(
        "weights-without-source",
        "a version needs weights to load",
        {"spec.weights": {"version": "v2"}},
        "Field required",
        "Required value",
        "spec.weights.source",
    ),
    InvalidCase(
        "model-path-escapes-volume",
        "'..' would leave the volume",
        {"spec.model.path": "models/../../etc"},
        "model.path must stay inside the volume",
        "model.path must stay inside the volume",
        "spec.model.path",
    ),
    InvalidCase(
        "absolute-model-path",
        "model.path is relative to the volume",
        {"spec.model.path": "/srv/models/tiny"},
        "String should match pattern",
        "should match",
        "spec.model.path",
    ),
    InvalidCase(
        "max-unavailable-zero",
        "a roll must be able to take a replica out",
        {"spec.updateStrategy": {"maxUnavailable": 0}},
        "greater than or equal to 1",
        "greater than or equal to 1",
        "spec.updateStrategy.maxUnavailable",
    ),
    InvalidCase(
        "toleration-exists-with-value",
        "Exists matches any value",
        {"spec.worker": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]}},
        "a toleration with operator Exists must not set value",
        "a toleration with operator Exists must not set value",
        "spec.worker.tolerations[0]",
    ),
    InvalidCase(
        "bad-cpu-quantity",
        "resources are Kubernetes quantities",
        {"spec.worker": {"resources": {"cpu": "lots"}}},
        "String should match pattern",
        "should match",
        "spec.worker.resources.cpu",
    ),
    InvalidCase(
        "unknown-field",
        "a typo must not be dropped silently",
        {"spec.replica": 2},
        "Extra inputs are not permitted",
        'unknown field "spec.replica"',
        "spec",
    ),
    InvalidCase(
        "name-too-long",
        "pod and Service names are built from it",
        {"metadata.name": "m" * 51},
        "metadata.name must be at most 50 characters",
        "metadata.name must be at most 50 characters",
        "metadata.name",
    ),
    InvalidCase(
        "name-ending-in-group",
        "another model's headless Service is <its name>-group: the names would collide",
        {"metadata.name": "tiny-group"},
        "metadata.name must not end in '-group'",
        "metadata.name must not end in '-group'",
        "metadata.name",
    ),
    InvalidCase(
        "name-with-dot",
        "the name becomes a Service name (DNS label)",
        {"metadata.name": "tiny.v1"},
        "metadata.name must be a DNS label",
        "metadata.name must be a DNS label",
        "metadata.name",
    ),
    # Each of the next ones was accepted by the CRD once, and its pods refused by the API server (or its workers
    # unable to start or to be reached), which the user saw only in the model's status.
    InvalidCase(
        "pod-label-key-with-space",
        "the pod's labels must be valid label keys",
        {"spec.worker": {"podTemplate": {"metadata": {"labels": {"team a": "x"}}}}},
        "worker.podTemplate.metadata.labels keys must be label keys",
        "worker.podTemplate.metadata.labels keys must be label keys",
        "spec.worker.podTemplate.metadata.labels",
    ),
    InvalidCase(
        "pod-label-value-with-space",
        "the pod's label values must be valid label values",
        {"spec.worker": {"podTemplate": {"metadata": {"labels": {"team": "a b"}}}}},
        "String should match pattern",
        "should match",
        "spec.worker.podTemplate.metadata.labels.team",
    ),
    InvalidCase(
        "pod-annotation-key-with-space",
        "the pod's annotations must have valid keys",
        {"spec.worker": {"podTemplate": {"metadata": {"annotations": {"a b": "c"}}}}},
        "worker.podTemplate.metadata.annotations keys must be annotation keys",
        "worker.podTemplate.metadata.annotations keys must be annotation keys",
        "spec.worker.podTemplate.metadata.annotations",
    ),
    InvalidCase(
        "too-many-pod-annotations",
        "a pod's annotations may not exceed 256 KiB; 57 of the longest would",
        {"spec.worker": {"podTemplate": {"metadata": {"annotations": {f"k{i}": "v" for i in range(57)}}}}},
        "at most 56 items",
        "must have at most 56 items",
        "spec.worker.podTemplate.metadata.annotations",
    ),
    InvalidCase(
        "node-selector-key-with-space",
        "nodeSelector keys are label keys",
        {"spec.worker": {"nodeSelector": {"gpu type": "h100"}}},
        "worker.nodeSelector keys must be label keys",
        "worker.nodeSelector keys must be label keys",
        "spec.worker.nodeSelector",
    ),
    InvalidCase(
        "node-selector-prefix-too-long",
        "a label key's prefix is at most 253 characters",
        {"spec.worker": {"nodeSelector": {"a" * 254 + "/gpu": "h100"}}},
        "worker.nodeSelector keys must be label keys",
        "worker.nodeSelector keys must be label keys",
        "spec.worker.nodeSelector",
    ),
    InvalidCase(
        "node-selector-value-with-space",
        "nodeSelector values are label values",
        {"spec.worker": {"nodeSelector": {"gpu": "h100 sxm"}}},
        "String should match pattern",
        "should match",
        "spec.worker.nodeSelector.gpu",
    ),
    InvalidCase(
        "toleration-key-with-space",
        "a toleration's key is a label key",
        {"spec.worker": {"tolerations": [{"key": "gpu type", "operator": "Exists"}]}},
        "String should match pattern",
        "should match",
        "spec.worker.tolerations[0].key",
    ),
    InvalidCase(
        "toleration-value-with-space",
        "a toleration's value is a label value",
        {"spec.worker": {"tolerations": [{"key": "gpu", "value": "a b"}]}},
        "String should match pattern",
        "should match",
        "spec.worker.tolerations[0].value",
    ),
    InvalidCase(
        "image-with-trailing-space",
        "the API server refuses an image with whitespace at either end",
        {"spec.worker": {"image": "ghcr.io/tidal-dev/tidal-worker:0.1.0 "}},
        "String should match pattern",
        "should match",
        "spec.worker.image",
    ),
    InvalidCase(
        "host-path-parent-segment",
        "the API server refuses a hostPath with '..' in a pod",
        {"spec.model.volume": {"hostPath": {"path": "/srv/../etc/models"}}},
        "model.volume.hostPath.path must not contain '..' segments",
        "model.volume.hostPath.path must not contain '..' segments",
        "spec.model.volume.hostPath.path",
    ),
    InvalidCase(
        "mount-path-root",
        "the model volume over / would hide the worker's own files",
        {"spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/"}},
        "model.volume would be mounted at /",
        "model.volume would be mounted at /",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "host-path-root-mounted-at-its-own-path",
        "a hostPath is mounted at its own path by default, and / there would hide the worker's own files",
        {"spec.model.volume": {"hostPath": {"path": "/"}}},
        "model.volume would be mounted at /",
        "model.volume would be mounted at /",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "gpu-resource-name-part-too-long",
        "the name of an extended resource is at most 63 characters",
        {"spec.worker": {"resources": {"gpusPerRank": 1, "gpuResourceName": "example.com/" + "g" * 64}}},
        "String should match pattern",
        "should match",
        "spec.worker.resources.gpuResourceName",
    ),
    InvalidCase(
        "gpu-resource-name-requests-prefix",
        "the API server refuses extended resource names under requests.",
        {"spec.worker": {"resources": {"gpusPerRank": 1, "gpuResourceName": "requests.example.com/gpu"}}},
        "gpuResourceName must not start with 'requests.'",
        "gpuResourceName must not start with 'requests.'",
        "spec.worker.resources.gpuResourceName",
    ),
    InvalidCase(
        "control-token-file-env",
        "a token file beside the token Tidal sets: the worker refuses to start",
        {"spec.worker": {"env": [{"name": "TIDAL_CONTROL_TOKEN_FILE", "value": "/etc/token"}]}},
        "worker.env must not set TIDAL_CONTROL_TOKEN_FILE, TIDAL_CONTROL_HOST",
        "worker.env must not set TIDAL_CONTROL_TOKEN_FILE, TIDAL_CONTROL_HOST",
        "spec.worker.env",
    ),
    InvalidCase(
        "control-host-env",
        "a control API away from the pod's IP is out of the operator's reach",
        {"spec.worker": {"env": [{"name": "TIDAL_CONTROL_HOST", "value": "127.0.0.1"}]}},
        "worker.env must not set TIDAL_CONTROL_TOKEN_FILE, TIDAL_CONTROL_HOST",
        "worker.env must not set TIDAL_CONTROL_TOKEN_FILE, TIDAL_CONTROL_HOST",
        "spec.worker.env",
    ),
    # Accepted once, and then each pod crash-looped or could not start its container.
    InvalidCase(
        "kv-blocks-and-kv-bytes-env",
        "the worker refuses to start with both ways of sizing the KV cache (exit code 2)",
        {"spec.worker": {"env": _env("TIDAL_NUM_KV_BLOCKS", "TIDAL_KV_CACHE_BYTES")}},
        "worker.env sets both TIDAL_NUM_KV_BLOCKS and TIDAL_KV_CACHE_BYTES",
        "worker.env sets both TIDAL_NUM_KV_BLOCKS and TIDAL_KV_CACHE_BYTES",
        "spec.worker.env",
    ),
    InvalidCase(
        "mount-path-proc",
        "the model volume over /proc: the container runtime refuses the mount",
        {"spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/proc"}},
        "model.volume would be mounted over a system directory",
        "model.volume would be mounted over a system directory",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "mount-path-under-sys",
        "the model volume under /sys would hide the kernel's view the GPU driver reads",
        {"spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/sys/models"}},
        "model.volume would be mounted over a system directory",
        "model.volume would be mounted over a system directory",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "host-path-under-proc-mounted-at-its-own-path",
        "a hostPath is mounted at its own path by default",
        {"spec.model.volume": {"hostPath": {"path": "/proc/models"}}},
        "model.volume would be mounted over a system directory",
        "model.volume would be mounted over a system directory",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "mount-path-dev",
        "the model volume over /dev would hide the device nodes (GPUs included)",
        {"spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "//dev/"}},
        "model.volume would be mounted over a system directory",
        "model.volume would be mounted over a system directory",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "mount-path-etc",
        "the model volume over /etc would hide passwd, hosts and resolv.conf",
        {"spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/etc"}},
        "model.volume would be mounted over a system directory",
        "model.volume would be mounted over a system directory",
        "spec.model.volume.mountPath",
    ),
    InvalidCase(
        "pod-template-mount-proc",
        "a pod template's volume over /proc: the container runtime refuses the mount",
        {"spec.worker": {"podTemplate": _template_mount("/proc")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.containers[0].volumeMounts[0].mountPath",
    ),
    InvalidCase(
        "pod-template-mount-under-sys",
        "a pod template's volume under /sys",
        {"spec.worker": {"podTemplate": _template_mount("/sys/fs/cgroup")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.containers[0].volumeMounts[0].mountPath",
    ),
    InvalidCase(
        "pod-template-mount-dev",
        "a pod template's volume over /dev would hide the device nodes",
        {"spec.worker": {"podTemplate": _template_mount("/dev")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.containers[0].volumeMounts[0].mountPath",
    ),
    InvalidCase(
        "pod-template-mount-etc",
        "a pod template's volume over /etc would hide passwd, hosts and resolv.conf",
        {"spec.worker": {"podTemplate": _template_mount("/etc/", container="sidecar")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.containers[0].volumeMounts[0].mountPath",
    ),
    InvalidCase(
        "pod-template-mount-root",
        "a pod template's volume over / would hide the container's own files",
        {"spec.worker": {"podTemplate": _template_mount("/", key="initContainers", container="init")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.initContainers[0].volumeMounts[0].mountPath",
    ),
    InvalidCase(
        "pod-template-mount-dot-segments",
        "'.' and '..' segments would reach a system directory by another spelling",
        {"spec.worker": {"podTemplate": _template_mount("/data/../proc")}},
        "worker.podTemplate.spec mounts a volume over a system directory",
        "worker.podTemplate.spec mounts a volume over a system directory",
        "spec.worker.podTemplate.spec.containers[0].volumeMounts[0].mountPath",
    ),
]

# Objects near the cases above that must stay accepted (the rules must not refuse what the API server takes in a pod).
ACCEPTED_VARIANTS: dict[str, dict[str, Any]] = {
    "prefixed-keys-and-empty-values": {
        "spec.worker": {
            "nodeSelector": {"node-role.kubernetes.io/gpu": "", "gpu": "h100_sxm.5"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "podTemplate": {
                "metadata": {
                    "labels": {"app.kubernetes.io/team": "A-1", "x": ""},
                    # The API server lowercases an annotation key before checking it.
                    "annotations": {"Example.com/Note": "any text at all", "b" * 253 + "/" + "c" * 63: "x"},
                }
            },
        }
    },
    "host-root-mounted-elsewhere": {"spec.model.volume": {"hostPath": {"path": "/"}, "mountPath": "/host"}},
    "many-pod-annotations": {
        "spec.worker": {"podTemplate": {"metadata": {"annotations": {f"k{i}": "v" for i in range(56)}}}}
    },
    "gpu-resource-name-at-its-limits": {
        "spec.worker": {"resources": {"gpusPerRank": 2, "gpuResourceName": "gpu.example.com/" + "g" * 63}}
    },
    "image-with-digest": {"spec.worker": {"image": "registry.example/tidal-worker@sha256:" + "a" * 64}},
    "one-kv-cache-size-env": {"spec.worker": {"env": _env("TIDAL_NUM_KV_BLOCKS", "HF_HOME")}},
    # Below /etc is fine (CA bundles under /etc/ssl, config files); /etc itself is not. Below /dev too: /dev/shm is
    # the usual way to give PyTorch and NCCL more shared memory, /dev/infiniband RDMA devices. A mount path that
    # only starts like a system directory is another directory.
    "mounts-below-etc-and-dev": {
        "spec.model.volume": {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/etc/tidal/models"},
        "spec.worker": {
            "podTemplate": {
                "spec": {
                    "containers": [
                        {
                            "name": "worker",
                            "volumeMounts": [
                                {"name": "certs", "mountPath": "/etc/ssl/certs"},
                                {"name": "shm", "mountPath": "/dev/shm"},
                                {"name": "data", "mountPath": "/process-data"},
                                {"name": "sysroot", "mountPath": "/system"},
                            ],
                        },
                        {"name": "sidecar", "image": "busybox", "volumeMounts": None},
                    ],
                    "initContainers": None,
                }
            }
        },
    },
    "host-path-under-dev-mounted-at-its-own-path": {"spec.model.volume": {"hostPath": {"path": "/dev/shm/models"}}},
    # The API server reads a JSON 1.0 for an integer field as 1 and stores 1 (checked against kube-apiserver v1.36.3);
    # the operator's model takes 1.0 as 1 too.
    "sleep-level-as-1.0": {"spec.sleep": {"level": 1.0}},
}


def build_variant(changes: dict[str, Any]) -> dict[str, Any]:
    return InvalidCase("variant", "", changes, "", "", "").build()
