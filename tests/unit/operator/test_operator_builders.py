"""Pure builders: pods, Services, Secret, NetworkPolicy and the pod-template merge."""

import base64

import pytest
from operator_fixtures import OPERATOR, TOKEN, make_model
from pydantic import SecretStr

from tidal.operator.api import constants as c
from tidal.operator.builders.merge import merge_values
from tidal.operator.builders.networkpolicy import build_network_policy
from tidal.operator.builders.owner import content_hash
from tidal.operator.builders.pod import build_pod, spec_identity
from tidal.operator.builders.secret import build_token_secret
from tidal.operator.builders.services import build_group_service, build_serving_service, endpoint
from tidal.operator.planner.actions import CreateSecret, PatchSecret


def _env(pod):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def _hash(pod):
    return pod["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]


def test_pod_identity_labels_and_owner():
    pod = build_pod(make_model({"replicas": 3}), replica=2, rank=0)
    meta = pod["metadata"]
    assert meta["name"] == "tiny-r2-0" and meta["namespace"] == "ml"
    labels = meta["labels"]
    assert labels[c.LABEL_MODEL] == "tiny" and labels[c.LABEL_REPLICA] == "2" and labels[c.LABEL_RANK] == "0"
    assert labels[c.LABEL_LEADER] == "true" and labels[c.LABEL_SERVING] == "true"
    assert labels["app.kubernetes.io/managed-by"] == "tidal-operator"
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "tidal.dev/v1alpha1",
        "kind": "InferenceModel",
        "name": "tiny",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert pod["spec"]["hostname"] == "tiny-r2-0" and pod["spec"]["subdomain"] == "tiny-group"
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_pod_command_env_probes_and_volume():
    model = make_model(
        {
            "model": {
                "volume": {"hostPath": {"path": "/srv/models"}},
                "path": "tiny-llama",
                "dtype": "bfloat16",
                "maxModelLen": 2048,
            },
            "serving": {"port": 9000, "controlPort": 9001},
            "worker": {"env": [{"name": "HF_HOME", "value": "/tmp/hf"}]},
        }
    )
    pod = build_pod(model, 0, 0)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["tidal-worker", "--model", "/srv/models/tiny-llama", "--port", "9000"]
    env = _env(pod)
    assert env["TIDAL_MODEL"] == "/srv/models/tiny-llama" and env["TIDAL_PORT"] == "9000"
    assert env["TIDAL_DTYPE"] == "bfloat16" and env["TIDAL_MAX_MODEL_LEN"] == "2048"
    assert env["TIDAL_CONTROL_PORT"] == "9001" and env["TIDAL_SERVED_MODEL_NAME"] == "tiny"
    assert env["TIDAL_CONTROL_TOKEN"] == {"secretKeyRef": {"name": "tiny-control-token", "key": "token"}}
    assert env["TIDAL_WEIGHTS_VERSION"] == "base" and env["TIDAL_WEIGHTS_PATH"] == "/srv/models/tiny-llama"
    assert env["HF_HOME"] == "/tmp/hf"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "serve"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"serve": 9000, "control": 9001}
    # A hostPath is mounted at its own path: the same path works on the node and in the pod.
    assert pod["spec"]["volumes"] == [{"name": "model", "hostPath": {"path": "/srv/models", "type": "Directory"}}]
    assert container["volumeMounts"] == [{"name": "model", "mountPath": "/srv/models", "readOnly": True}]


def test_pvc_volume_gpus_and_scheduling():
    model = make_model(
        {
            "model": {"volume": {"persistentVolumeClaim": {"claimName": "weights"}}, "path": "qwen"},
            "weights": {"version": "v2", "source": "ckpt/v2"},
            "worker": {
                "resources": {"gpusPerRank": 2, "cpu": "8", "memory": "64Gi"},
                "nodeSelector": {"gpu": "h200"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        }
    )
    pod = build_pod(model, 0, 0)
    container = pod["spec"]["containers"][0]
    assert container["command"][2] == "/models/qwen"
    assert _env(pod)["TIDAL_WEIGHTS_PATH"] == "/models/ckpt/v2" and _env(pod)["TIDAL_WEIGHTS_VERSION"] == "v2"
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    amounts = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    assert container["resources"] == {"requests": amounts, "limits": amounts}
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_kv_cache_dtype_reaches_the_worker_only_when_asked_for():
    """`auto` sets no variable (a model that does not ask keeps its pods' hash); fp8 does, and is a new pod."""
    base = build_pod(make_model(), 0, 0)
    assert "TIDAL_KV_CACHE_DTYPE" not in _env(base)
    source = {"volume": {"hostPath": {"path": "/srv/models"}}, "path": "tiny-llama", "kvCacheDtype": "fp8"}
    fp8 = build_pod(make_model({"model": source}), 0, 0)
    assert _env(fp8)["TIDAL_KV_CACHE_DTYPE"] == "fp8"
    assert _hash(fp8) != _hash(base)


def test_weight_dtype_reaches_the_worker_only_when_asked_for():
    """`auto` sets no variable (a model that does not ask keeps its pods' hash); fp8 does, and is a new pod."""
    base = build_pod(make_model(), 0, 0)
    assert "TIDAL_WEIGHT_DTYPE" not in _env(base)
    source = {"volume": {"hostPath": {"path": "/srv/models"}}, "path": "tiny-llama", "weightDtype": "fp8"}
    fp8 = build_pod(make_model({"model": source}), 0, 0)
    assert _env(fp8)["TIDAL_WEIGHT_DTYPE"] == "fp8"
    assert _hash(fp8) != _hash(base)


def test_hash_ignores_in_place_changes_and_catches_the_rest():
    base = _hash(build_pod(make_model(), 0, 0))
    assert _hash(build_pod(make_model({"weights": {"version": "v2", "source": "x"}}), 0, 0)) == base
    assert _hash(build_pod(make_model({"sleep": {"state": "Asleep"}}), 0, 0)) == base
    assert _hash(build_pod(make_model({"replicas": 5}), 0, 0)) == base
    assert _hash(build_pod(make_model({"worker": {"image": "other:2"}}), 0, 0)) != base
    assert _hash(build_pod(make_model({"serving": {"port": 9000}}), 0, 0)) != base


def test_the_worker_is_told_its_termination_message_path_and_the_log_is_the_fallback():
    pod = build_pod(make_model(), 0, 0)
    worker = pod["spec"]["containers"][0]
    assert worker["terminationMessagePath"] == "/dev/termination-log"
    assert worker["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert _env(pod)["TIDAL_TERMINATION_MESSAGE_PATH"] == "/dev/termination-log"
    # The settings came after pods existed: a pod built without them is not outdated (the hash leaves them out).
    bare = {**worker, "env": [e for e in worker["env"] if e["name"] != "TIDAL_TERMINATION_MESSAGE_PATH"]}
    del bare["terminationMessagePath"], bare["terminationMessagePolicy"]
    unstamped = {k: v for k, v in pod["metadata"]["annotations"].items() if k != c.ANNOTATION_SPEC_HASH}
    old = {"metadata": {**pod["metadata"], "annotations": unstamped}, "spec": {**pod["spec"], "containers": [bare]}}
    assert content_hash(spec_identity(old)) == _hash(pod)
    # A template may pick another policy (that replaces the pods) but cannot move the path the worker is told.
    template = {
        "spec": {"containers": [{"name": "worker", "terminationMessagePath": "/x", "terminationMessagePolicy": "File"}]}
    }
    custom = build_pod(make_model({"worker": {"podTemplate": template}}), 0, 0)
    custom_worker = custom["spec"]["containers"][0]
    assert custom_worker["terminationMessagePath"] == "/dev/termination-log"
    assert custom_worker["terminationMessagePolicy"] == "File" and _hash(custom) != _hash(pod)


def test_pod_template_merge_rule():
    template = {
        "metadata": {"labels": {"team": "ml", c.LABEL_MODEL: "hijack"}, "annotations": {"note": "x"}},
        "spec": {
            "priorityClassName": "high",
            "containers": [
                {
                    "name": "worker",
                    "command": ["sh", "-c", "evil"],
                    "resources": {"limits": {"ephemeral-storage": "10Gi"}},
                    "env": [
                        {"name": "EXTRA", "value": "1"},
                        {"name": "TIDAL_RANK", "value": "9"},
                        {"name": "TIDAL_CONTROL_HOST", "value": "127.0.0.1"},
                    ],
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "enableServiceLinks": None,
        },
    }
    pod = build_pod(make_model({"worker": {"podTemplate": template}}), 0, 0)
    spec = pod["spec"]
    worker, sidecar = spec["containers"]
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert spec["priorityClassName"] == "high" and "enableServiceLinks" not in spec
    assert worker["command"][0] == "tidal-worker"  # Tidal owns the command
    assert worker["resources"]["limits"] == {"ephemeral-storage": "10Gi"}  # maps merge
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["EXTRA"] == "1" and env["TIDAL_RANK"] == "0"  # reserved variables stay Tidal's
    assert "TIDAL_CONTROL_HOST" not in env  # guarded ones stay unset: the operator must reach the control API
    assert [m["name"] for m in worker["volumeMounts"]] == ["model", "cache"]  # named lists merge by name
    assert [v["name"] for v in spec["volumes"]] == ["model", "cache"]
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "ml" and labels[c.LABEL_MODEL] == "tiny"
    assert pod["metadata"]["annotations"]["note"] == "x" and c.ANNOTATION_SPEC_HASH in pod["metadata"]["annotations"]


@pytest.mark.parametrize(
    "override",
    [{"hostname": "shared", "subdomain": "elsewhere"}, {"hostname": None, "subdomain": None}],
    ids=["replaced", "removed"],
)
def test_pod_template_cannot_move_a_rank_off_its_dns_name(override):
    # `<pod>.<model>-group` resolves only while each pod keeps its own hostname under the group Service's subdomain.
    model = make_model({"replicas": 2, "worker": {"podTemplate": {"spec": {**override, "priorityClassName": "high"}}}})
    pod = build_pod(model, 1, 0)
    assert pod["spec"]["hostname"] == "tiny-r1-0" and pod["spec"]["subdomain"] == "tiny-group"
    assert pod["spec"]["priorityClassName"] == "high"  # the rest of the template still applies
    plain = build_pod(
        make_model({"replicas": 2, "worker": {"podTemplate": {"spec": {"priorityClassName": "high"}}}}), 1, 0
    )
    assert _hash(pod) == _hash(plain)  # an overridden owned field is no change of the pod


def test_merge_values_lists_without_names_are_replaced():
    assert merge_values({"a": [1, 2], "b": {"c": 1}}, {"a": [3], "b": {"d": 2}}) == {"a": [3], "b": {"c": 1, "d": 2}}
    assert merge_values({"x": [{"name": "a", "v": 1}]}, {"x": [{"name": "a", "w": 2}]}) == {
        "x": [{"name": "a", "v": 1, "w": 2}]
    }


def test_services_select_the_group_and_the_serving_pods():
    model = make_model()
    group, serving = build_group_service(model), build_serving_service(model)
    assert group["metadata"]["name"] == "tiny-group" and group["spec"]["clusterIP"] == "None"
    assert group["spec"]["publishNotReadyAddresses"] is True
    assert group["spec"]["selector"] == {c.LABEL_MODEL: "tiny"}
    assert serving["metadata"]["name"] == "tiny"
    assert serving["spec"]["selector"] == {c.LABEL_MODEL: "tiny", c.LABEL_SERVING: "true"}
    assert serving["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "serve", "protocol": "TCP"}]
    assert endpoint(model) == "http://tiny.ml.svc:8000"


def test_secret_holds_token_and_never_prints_it():
    model = make_model()
    secret = build_token_secret(model, TOKEN)
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN.get_secret_value()
    for action in (CreateSecret(manifest=secret), PatchSecret(manifest=secret)):
        for text in (repr(action), str(action), action.describe(), action.model_dump_json()):
            assert TOKEN.get_secret_value() not in text and secret["data"]["token"] not in text
    with pytest.raises(ValueError, match="at least"):
        build_token_secret(model, SecretStr("short"))


def _admitted_port(rule: dict, pod: dict) -> int:
    """The container port of `pod` that the rule's one port admits (a name resolves on each pod, as in Kubernetes)."""
    ((port,),) = [[p["port"] for p in rule["ports"]]]
    if isinstance(port, int):
        return port
    (container,) = pod["spec"]["containers"]
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_network_policy_opens_control_port_to_the_operator_only():
    policy = build_network_policy(make_model(), OPERATOR)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {c.LABEL_MODEL: "tiny"}} and spec["policyTypes"] == ["Ingress"]
    open_rule, control_rule = spec["ingress"]
    pod = build_pod(make_model(), 0, 0)
    assert "from" not in open_rule and _admitted_port(open_rule, pod) == 8000
    assert _admitted_port(control_rule, pod) == 8001
    (peer,) = control_rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "tidal-system"}}
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "tidal-operator"}}


def test_a_port_change_keeps_the_pods_not_yet_replaced_reachable():
    # The policy is patched at once, the pods are replaced replica by replica: until its turn, a pod listens on the
    # old ports, and clients (through the Service's named targetPort) and the operator must still reach it there.
    old = make_model()
    new = make_model({"serving": {"port": 9000, "controlPort": 9001}}, generation=2)
    open_rule, control_rule = build_network_policy(new, OPERATOR)["spec"]["ingress"]
    for model, serve, control in ((old, 8000, 8001), (new, 9000, 9001)):
        pod = build_pod(model, 0, 0)
        assert (_admitted_port(open_rule, pod), _admitted_port(control_rule, pod)) == (serve, control)
