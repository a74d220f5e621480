"""A model created on a weights source that does not exist crash-loops; fixing spec.weights reaches its pods (they
are replaced, since they never served), and a later change of the source alone, under the same version, rolls into
the same pods in place. Checked against what the workers themselves report."""

import pytest
from operator_e2e import (
    condition,
    create_model,
    model_manifest,
    patch_spec,
    pod_identity,
    synced_to,
    wait_model,
    worker_state,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_bad_source_is_fixed_by_the_spec_and_a_source_alone_rolls(devcluster, namespace, models):
    bad = {"replicas": 2, "weights": {"version": "a1", "source": "no-such-checkpoint"}}
    create_model(devcluster, namespace, model_manifest("fixme", models, bad))

    def crash_looping(obj: dict) -> bool:
        degraded = condition(obj, "Degraded")
        return degraded.get("status") == "True" and degraded.get("reason") == "CrashLoop"

    wait_model(devcluster, namespace, "fixme", crash_looping, timeout_s=120, what="Degraded=CrashLoop")
    looping = pod_identity(devcluster, namespace, "fixme")

    patch_spec(devcluster, namespace, "fixme", {"weights": {"version": "b", "source": "tiny-llama-b"}})
    obj = wait_model(devcluster, namespace, "fixme", synced_to("b"), timeout_s=180, what="synced to b")
    assert condition(obj, "Degraded")["status"] == "False", condition(obj, "Degraded")
    assert obj["status"]["weightsSource"] == str(models / "tiny-llama-b")
    fixed = pod_identity(devcluster, namespace, "fixme")
    assert sorted(fixed) == sorted(looping)
    assert all(fixed[pod][0] != looping[pod][0] for pod in fixed)  # new pods: the crash-looping ones could not load
    for pod in fixed:
        state = worker_state(devcluster, namespace, "fixme", pod)
        assert (state["weights_version"], state["weights_source"]) == ("b", str(models / "tiny-llama-b"))

    # The same version from another directory is other weights: rolled in place, Synced only once both serve it.
    generation = obj["metadata"]["generation"]
    patch_spec(devcluster, namespace, "fixme", {"weights": {"version": "b", "source": "tiny-llama"}})

    def moved(o: dict) -> bool:
        return o["metadata"]["generation"] > generation and synced_to("b")(o)

    obj = wait_model(devcluster, namespace, "fixme", moved, timeout_s=120, what="synced to b from tiny-llama")
    assert obj["status"]["weightsSource"] == str(models / "tiny-llama")
    assert pod_identity(devcluster, namespace, "fixme") == fixed  # in place: same pods, no restart
    for pod in fixed:
        assert worker_state(devcluster, namespace, "fixme", pod)["weights_source"] == str(models / "tiny-llama")
