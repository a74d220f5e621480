"""A pod template the CRD accepts and the API server refuses (issue 16): `resources.limits.cpu: lots`. The operator
dry-runs the new pod before deleting anything, so a running model keeps its pod and serves, and says why in
Degraded (with the API server's message) and one Warning Event; the old spec back clears it; a new model with such a
template says so at once."""

import time

import pytest
from operator_e2e import (
    complete,
    condition,
    create_model,
    events_of,
    model_manifest,
    model_pods,
    patch_spec,
    phase_is,
    wait_model,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LOTS = {"spec": {"containers": [{"name": "worker", "resources": {"limits": {"cpu": "lots"}}}]}}
# What the API server says when it cannot decode the quantity.
API_MESSAGE = "quantities must match the regular expression"


def _refused(obj: dict) -> bool:
    cond = condition(obj, "Degraded")
    current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
    return current and cond.get("status") == "True" and cond.get("reason") == "PodTemplateRefused"


def _refusal_events(devcluster, namespace: str, name: str) -> list:
    return [e for e in events_of(devcluster, namespace, name) if e.reason == "PodTemplateRefused"]


def test_a_refused_template_keeps_the_serving_pod_and_the_old_spec_clears_it(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("tpl", models))
    wait_model(devcluster, namespace, "tpl", phase_is("Ready"), timeout_s=120, what="phase Ready")
    uid = model_pods(devcluster, namespace, "tpl")["tpl-r0-0"].metadata.uid

    patch_spec(devcluster, namespace, "tpl", {"worker": {"podTemplate": LOTS}})
    obj = wait_model(devcluster, namespace, "tpl", _refused, timeout_s=30, what="Degraded=PodTemplateRefused")
    message = condition(obj, "Degraded")["message"]
    assert API_MESSAGE in message and "tpl-r0-0" in message, message
    assert condition(obj, "Ready")["status"] == "True"
    assert model_pods(devcluster, namespace, "tpl")["tpl-r0-0"].metadata.uid == uid
    complete(devcluster, namespace, "tpl-r0-0", "hello")  # still serving: raises on an HTTP error
    events = wait_until(lambda: _refusal_events(devcluster, namespace, "tpl"), 30, "a PodTemplateRefused Event")
    assert events[0].type == "Warning" and API_MESSAGE in events[0].message

    # Passes go on (resync 5 s) and the refusal is asked about again (after 5 s): the pod stays, and the same
    # refusal is not posted twice.
    time.sleep(12)
    assert model_pods(devcluster, namespace, "tpl")["tpl-r0-0"].metadata.uid == uid
    assert len(_refusal_events(devcluster, namespace, "tpl")) == 1

    patch_spec(devcluster, namespace, "tpl", {"worker": {"podTemplate": None}})
    obj = wait_model(devcluster, namespace, "tpl", phase_is("Ready"), timeout_s=30, what="Ready again")
    assert condition(obj, "Degraded")["status"] == "False"
    assert model_pods(devcluster, namespace, "tpl")["tpl-r0-0"].metadata.uid == uid  # never replaced


def test_a_new_model_with_a_refused_template_says_so_at_once(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("tpl-new", models, {"worker": {"podTemplate": LOTS}}))
    obj = wait_model(devcluster, namespace, "tpl-new", _refused, timeout_s=30, what="Degraded=PodTemplateRefused")
    assert API_MESSAGE in condition(obj, "Degraded")["message"]
    assert obj["status"]["phase"] == "Degraded"
    assert model_pods(devcluster, namespace, "tpl-new") == {}
    wait_until(lambda: _refusal_events(devcluster, namespace, "tpl-new"), 30, "a PodTemplateRefused Event")
