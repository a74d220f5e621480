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
]
