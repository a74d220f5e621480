"""The operator touches only what it owns (issue 16): an object under one of a model's child names that the model
does not control is never patched, adopted or deleted, and the model says so in a Degraded condition."""

import pytest
from operator_e2e import (
    condition,
    create_model,
    model_manifest,
    model_pods,
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
