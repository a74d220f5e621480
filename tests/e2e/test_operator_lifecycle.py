"""The operator installed by the chart, on the real control plane with real worker processes: apply -> Ready,
status and columns, describe with conditions and events, a deleted pod comes back, a deleted token Secret is
replaced and the pods follow it, a crash loop is reported and clears, deleting the model removes its children."""

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from operator_e2e import (
    condition,
    control_token,
    create_model,
    events_of,
    model_manifest,
    model_pods,
    patch_spec,
    phase_is,
    wait_model,
    wait_until,
    worker_state,
)

from tidal.devcluster.testing import is_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_apply_example_is_ready_with_status_columns_and_events(devcluster, namespace, models, tmp_path):
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump(model_manifest("tiny", models)))
    devcluster.kubectl("apply", "-n", namespace, "-f", str(manifest))
    obj = wait_model(devcluster, namespace, "tiny", phase_is("Ready"), timeout_s=120, what="phase Ready")

    status = obj["status"]
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert (status["readyRanks"], status["totalRanks"], status["ready"]) == (1, 1, "1/1")
    source = str(models / "tiny-llama")  # where the worker reports reading its weights from
    rank = {
        "pod": "tiny-r0-0",
        "replica": 0,
        "rank": 0,
        "state": "Ready",
        "weightsVersion": "base",
        "weightsSource": source,
    }
    assert status["ranks"] == [rank]
    assert status["weightsVersion"] == "base" and status["sleepState"] == "Awake"
    assert status["endpoint"] == f"http://tiny.{namespace}.svc:8000"
    expected = {"Ready": "True", "Progressing": "False", "Degraded": "False", "Sleeping": "False"}
    expected["WeightsSynced"] = "True"
    assert {t: condition(obj, t).get("status") for t in expected} == expected
    assert condition(obj, "Ready")["reason"] == "AllRanksReady"

    table = devcluster.kubectl("get", "tim", "tiny", "-n", namespace).stdout.split()
    assert [w for w in table if w in ("Ready", "1/1", "base", "Awake")] == ["Ready", "1/1", "base", "Awake"]
    wait_until(lambda: events_of(devcluster, namespace, "tiny"), 30, "an Event on the model")
    described = devcluster.kubectl("describe", "tim", "tiny", "-n", namespace).stdout
    for text in ("Conditions:", "AllRanksReady", "WeightsSynced", "Events:", "tidal-operator"):
        assert text in described, described

    # Children: both Services, the token Secret and the NetworkPolicy, each owned by the model.
    uid = obj["metadata"]["uid"]
    children = [
        devcluster.core.read_namespaced_service("tiny", namespace),
        devcluster.core.read_namespaced_service("tiny-group", namespace),
        devcluster.core.read_namespaced_secret("tiny-control-token", namespace),
    ]
    for child in children:
        assert [ref.uid for ref in child.metadata.owner_references] == [uid]


def test_deleted_pod_is_recreated_and_deleting_the_model_removes_children(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("tiny", models))
    wait_model(devcluster, namespace, "tiny", phase_is("Ready"), timeout_s=120, what="phase Ready")
    old_uid = model_pods(devcluster, namespace, "tiny")["tiny-r0-0"].metadata.uid

    devcluster.core.delete_namespaced_pod("tiny-r0-0", namespace)
    pod = devcluster.wait_pod(
        namespace, "tiny-r0-0", lambda p: p["metadata"]["uid"] != old_uid and is_ready(p), timeout_s=90,
        what="a new ready pod",
    )  # fmt: skip
    assert pod["metadata"]["uid"] != old_uid
    wait_model(devcluster, namespace, "tiny", phase_is("Ready"), timeout_s=60, what="Ready again")

    # The token Secret deleted: the operator makes a new token, and the worker, which still holds the old one (it
    # answers the operator 401), is replaced so that it reads the new one.
    old_token = control_token(devcluster, namespace, "tiny")
    old_uid = pod["metadata"]["uid"]
    devcluster.core.delete_namespaced_secret("tiny-control-token", namespace)
    pod = devcluster.wait_pod(
        namespace, "tiny-r0-0", lambda p: p["metadata"]["uid"] != old_uid and is_ready(p), timeout_s=90,
        what="a pod started with the new token",
    )  # fmt: skip
    assert control_token(devcluster, namespace, "tiny") != old_token
    wait_model(devcluster, namespace, "tiny", phase_is("Ready"), timeout_s=60, what="Ready with the new token")
    worker_state(devcluster, namespace, "tiny", "tiny-r0-0")  # the current token opens the control API

    devcluster.kubectl("delete", "tim", "tiny", "-n", namespace, "--wait=true", timeout=60)

    def gone() -> bool:
        try:
            devcluster.core.read_namespaced_secret("tiny-control-token", namespace)
            return False
        except ApiException as exc:
            if exc.status != 404:
                raise
        services = devcluster.core.list_namespaced_service(namespace).items
        return not model_pods(devcluster, namespace, "tiny") and not services

    wait_until(gone, 60, "pods, Services and Secret garbage-collected")


def test_crash_loop_sets_degraded_and_recovery_clears_it(devcluster, namespace, models):
    # A model directory that does not exist: the worker exits at once with a configuration error, again and again.
    create_model(devcluster, namespace, model_manifest("crashy", models, {"model": {"path": "no-such-model"}}))
    obj = wait_model(
        devcluster, namespace, "crashy", lambda o: condition(o, "Degraded").get("status") == "True", timeout_s=90,
        what="Degraded",
    )  # fmt: skip
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "CrashLoop" and "crashy-r0-0" in degraded["message"], degraded
    assert obj["status"]["phase"] == "Degraded" and obj["status"]["ranks"][0]["state"] == "Failed"

    # The Event follows the status write that carried the flip.
    def warned() -> bool:
        return any(e.type == "Warning" and e.reason == "CrashLoop" for e in events_of(devcluster, namespace, "crashy"))

    wait_until(warned, 30, "a Warning event CrashLoop")

    # Fixing the spec replaces the pod; the model recovers and the condition clears.
    patch_spec(devcluster, namespace, "crashy", {"model": {"path": "tiny-llama"}})
    obj = wait_model(devcluster, namespace, "crashy", phase_is("Ready"), timeout_s=120, what="recovered")
    assert condition(obj, "Degraded")["status"] == "False" and condition(obj, "Degraded")["reason"] == "AsExpected"
