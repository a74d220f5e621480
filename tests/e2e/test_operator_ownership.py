"""The operator touches only what it owns (issue 16): an object under one of a model's child names that the model
does not control is never patched, adopted or deleted, and the model says so in a Degraded condition."""

import pytest
from operator_e2e import (
    condition,
    create_model,
    events_of,
    model_manifest,
    model_pods,
    phase_is,
    wait_model,
    wait_until,
)

from tidal.operator.api import constants as c

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _foreign(obj: dict) -> bool:
    cond = condition(obj, "Degraded")
    return cond.get("status") == "True" and cond.get("reason") == "ForeignObject"


def test_a_model_named_like_an_existing_service_leaves_it_alone(devcluster, namespace, models):
    service = {
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }
    devcluster.core.create_namespaced_service(namespace, service)
    create_model(devcluster, namespace, model_manifest("web", models))
    obj = wait_model(devcluster, namespace, "web", _foreign, timeout_s=60, what="Degraded=ForeignObject")
    assert "Service/web exists and is not this model's (no controller)" in condition(obj, "Degraded")["message"]
    kept = devcluster.core.read_namespaced_service("web", namespace)
    assert kept.metadata.owner_references is None and kept.spec.selector == {"app": "web"}
    assert [p.port for p in kept.spec.ports] == [80]
    # Deleting the model garbage-collects what it owns, and only that.
    devcluster.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, "web")
    wait_until(lambda: not model_pods(devcluster, namespace, "web"), 60, "the model's pods gone")
    assert devcluster.core.read_namespaced_service("web", namespace).spec.selector == {"app": "web"}


def test_a_planted_token_secret_is_not_used_and_no_pod_mounts_it(devcluster, namespace, models):
    secret = {"metadata": {"name": "tok-control-token"}, "stringData": {"token": "planted"}}
    devcluster.core.create_namespaced_secret(namespace, secret)
    create_model(devcluster, namespace, model_manifest("tok", models))
    obj = wait_model(devcluster, namespace, "tok", _foreign, timeout_s=60, what="Degraded=ForeignObject")
    assert "Secret/tok-control-token" in condition(obj, "Degraded")["message"]
    assert model_pods(devcluster, namespace, "tok") == {}
    planted = devcluster.core.read_namespaced_secret("tok-control-token", namespace)
    assert planted.metadata.owner_references is None


def test_a_pod_planted_under_a_rank_name_is_left_alone_and_the_rank_follows_once_it_is_gone(
    devcluster, namespace, models
):
    planted = {
        "metadata": {"name": "pp-r1-0", "labels": {"app": "planted"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            # The node agent ignores the image and runs the command as a local process.
            "containers": [{"name": "main", "image": "not-used", "command": ["sleep", "3600"]}],
        },
    }
    devcluster.core.create_namespaced_pod(namespace, planted)
    create_model(devcluster, namespace, model_manifest("pp", models, {"replicas": 2}))
    obj = wait_model(devcluster, namespace, "pp", _foreign, timeout_s=60, what="Degraded=ForeignObject")
    assert "Pod/pp-r1-0 exists and is not this model's (no controller)" in condition(obj, "Degraded")["message"]
    wait_until(lambda: "pp-r0-0" in model_pods(devcluster, namespace, "pp"), 60, "the other rank's pod")
    kept = devcluster.core.read_namespaced_pod("pp-r1-0", namespace)
    assert kept.metadata.owner_references is None and kept.metadata.labels == {"app": "planted"}
    warnings = [e for e in events_of(devcluster, namespace, "pp") if e.reason == "ForeignObject"]
    assert warnings and warnings[0].type == "Warning" and "Pod/pp-r1-0" in warnings[0].message
    # Once it is gone the rank gets its own pod, and the model serves on both replicas.
    devcluster.core.delete_namespaced_pod("pp-r1-0", namespace)
    obj = wait_model(devcluster, namespace, "pp", phase_is("Ready"), timeout_s=150, what="Ready on both ranks")
    assert condition(obj, "Degraded")["status"] == "False"
    assert set(model_pods(devcluster, namespace, "pp")) == {"pp-r0-0", "pp-r1-0"}
