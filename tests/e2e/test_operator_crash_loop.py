"""A worker that dies at start-up, again and again, on the real control plane: the model is Degraded once, with the
worker's own error (its termination message, which the node agent reads as the kubelet does), and stays so across
restarts, with one Event for the whole loop."""

import pytest
from operator_e2e import condition, create_model, events_of, get_model, model_manifest, wait_model

from tidal.devcluster.testing import restart_count_at_least

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _has_status(pod: dict) -> bool:
    return bool(pod.get("status", {}).get("containerStatuses"))


def _restarts(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0].get("restartCount", 0))


def test_a_worker_that_cannot_start_is_degraded_steadily_with_its_own_error(devcluster, namespace, models):
    # No such model directory: the worker refuses its configuration and exits 2 within a second or two of starting.
    create_model(devcluster, namespace, model_manifest("doomed", models, {"model": {"path": "no-such-model"}}))
    own_error = f"model directory '{models / 'no-such-model'}' does not exist"

    def degraded_with_own_error(obj: dict) -> bool:
        degraded = condition(obj, "Degraded")
        return degraded.get("status") == "True" and own_error in degraded.get("message", "")

    obj = wait_model(devcluster, namespace, "doomed", degraded_with_own_error, timeout_s=90, what="Degraded, why")
    first = condition(obj, "Degraded")
    assert first["reason"] == "CrashLoop" and "doomed-r0-0 keeps crashing" in first["message"], first
    assert "last exit code 2 (Error): invalid configuration:" in first["message"], first

    seen = _restarts(devcluster.wait_pod(namespace, "doomed-r0-0", _has_status, timeout_s=30))
    pod = devcluster.wait_pod(
        namespace, "doomed-r0-0", restart_count_at_least(seen + 2), timeout_s=90, what="two more restarts"
    )
    terminated = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert terminated["exitCode"] == 2 and own_error in terminated["message"], terminated

    # Between those restarts the container ran each time: the condition never left True, and said so once.
    later = condition(get_model(devcluster, namespace, "doomed"), "Degraded")
    assert later["status"] == "True" and later["reason"] == "CrashLoop", later
    assert later["lastTransitionTime"] == first["lastTransitionTime"], (first, later)
    events = events_of(devcluster, namespace, "doomed")
    told = "\n".join(f"{e.type} {e.reason}: {e.message}" for e in events)
    assert [(e.type, e.reason) for e in events] == [("Warning", "CrashLoop")], told
    assert own_error in events[0].message, told
