"""Sleep/wake and in-place weight rolls through the operator, checked against the workers themselves and against
transformers: same greedy output after a wake, weights changed while asleep reach each rank before its wake, new
weights without pod restarts, a broken checkpoint held as Degraded while the old version keeps serving, and an
operator restart in the middle of a roll."""

from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch
from operator_e2e import (
    OPERATOR_NS,
    complete,
    condition,
    create_model,
    lease_holder,
    model_manifest,
    model_pods,
    operator_pods,
    patch_spec,
    phase_is,
    pod_identity,
    synced_to,
    wait_model,
    wait_until,
    worker_checksum,
    worker_state,
)
from transformers import AutoTokenizer

from tidal.devcluster.testing import DevCluster, is_ready
from tidal.worker.testing.hf_reference import load_reference_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The tide comes in twice a day, and"
NEW_TOKENS = 12


@torch.no_grad()
def transformers_text(model_dir: Path, prompt: list[int]) -> str:
    model = load_reference_model(model_dir)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )  # [1, len(prompt) + NEW_TOKENS]
    return AutoTokenizer.from_pretrained(model_dir).decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)


def test_sleep_then_wake_serves_the_same_greedy_output(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("sleepy", models, {"replicas": 2}))
    wait_model(devcluster, namespace, "sleepy", phase_is("Ready"), timeout_s=150, what="Ready")
    pods = sorted(model_pods(devcluster, namespace, "sleepy"))
    before = [complete(devcluster, namespace, pod, PROMPT, NEW_TOKENS) for pod in pods]

    patch_spec(devcluster, namespace, "sleepy", {"sleep": {"state": "Asleep"}})
    obj = wait_model(
        devcluster, namespace, "sleepy", lambda o: condition(o, "Sleeping").get("status") == "True", timeout_s=60,
        what="Sleeping=True",
    )  # fmt: skip
    assert condition(obj, "Sleeping")["reason"] == "Requested" and obj["status"]["phase"] == "Sleeping"
    assert obj["status"]["sleepState"] == "Asleep" and [r["state"] for r in obj["status"]["ranks"]] == ["Asleep"] * 2
    assert condition(obj, "Ready")["status"] == "False" and condition(obj, "Ready")["reason"] == "Asleep"
    for pod in pods:
        state = worker_state(devcluster, namespace, "sleepy", pod)
        assert state["sleep_state"] == "asleep" and state["sleep_level"] == 1

    patch_spec(devcluster, namespace, "sleepy", {"sleep": {"state": "Awake"}})
    obj = wait_model(devcluster, namespace, "sleepy", phase_is("Ready"), timeout_s=90, what="Ready after wake")
    assert condition(obj, "Sleeping")["status"] == "False"
    for pod, text in zip(pods, before, strict=True):
        assert worker_state(devcluster, namespace, "sleepy", pod)["sleep_state"] == "awake"
        assert complete(devcluster, namespace, pod, PROMPT, NEW_TOKENS) == text

    # Weights changed while asleep (level 1: the old ones stay in host memory). Each rank gets the update before its
    # wake, so none serves the old weights again under the new spec.
    patch_spec(devcluster, namespace, "sleepy", {"sleep": {"state": "Asleep"}})
    wait_model(
        devcluster, namespace, "sleepy", lambda o: condition(o, "Sleeping").get("status") == "True", timeout_s=60,
        what="Sleeping=True again",
    )  # fmt: skip
    patch_spec(devcluster, namespace, "sleepy", {"weights": {"version": "b", "source": "tiny-llama-b"}})
    wait_model(
        devcluster, namespace, "sleepy", lambda o: condition(o, "WeightsSynced").get("reason") == "PausedWhileAsleep",
        timeout_s=30, what="the roll waiting while asleep",
    )  # fmt: skip
    patch_spec(devcluster, namespace, "sleepy", {"sleep": {"state": "Awake"}})
    wait_model(devcluster, namespace, "sleepy", synced_to("b"), timeout_s=120, what="awake on b")
    log = devcluster.pod_log(OPERATOR_NS, lease_holder(devcluster), "operator").splitlines()
    prompt = AutoTokenizer.from_pretrained(models / "tiny-llama-b")(PROMPT)["input_ids"]
    expected = transformers_text(models / "tiny-llama-b", prompt)
    for pod in pods:
        mine = [line for line in log if f"{namespace}/sleepy: " in line]
        last_sleep = max(i for i, line in enumerate(mine) if f": sleep {pod} " in line)
        after = [line.split(f"{namespace}/sleepy: ")[1] for line in mine[last_sleep + 1 :]]
        steps = [step.split(" ")[0] for step in after if f" {pod}" in step and step.startswith(("update", "wake"))]
        assert steps == ["update", "wake"], after  # the update staged while asleep, then the wake: one read, of b
        assert complete(devcluster, namespace, pod, prompt, NEW_TOKENS) == expected


def test_weight_roll_in_place_then_a_broken_checkpoint_is_held(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("rolling", models, {"replicas": 2}))
    wait_model(devcluster, namespace, "rolling", phase_is("Ready"), timeout_s=150, what="Ready")
    pods_before = pod_identity(devcluster, namespace, "rolling")
    assert len(pods_before) == 2
    sums_a = {worker_checksum(devcluster, namespace, "rolling", pod) for pod in pods_before}
    prompt = AutoTokenizer.from_pretrained(models / "tiny-llama-b")(PROMPT)["input_ids"]
    text_a = complete(devcluster, namespace, "rolling-r0-0", prompt, NEW_TOKENS)

    patch_spec(devcluster, namespace, "rolling", {"weights": {"version": "b", "source": "tiny-llama-b"}})
    obj = wait_model(devcluster, namespace, "rolling", synced_to("b"), timeout_s=120, what="synced to b")
    assert [r["weightsVersion"] for r in obj["status"]["ranks"]] == ["b", "b"]
    # In place: the same pods (UIDs) that never restarted.
    assert pod_identity(devcluster, namespace, "rolling") == pods_before
    expected = transformers_text(models / "tiny-llama-b", prompt)
    assert expected != text_a  # the two versions really differ
    for pod in pods_before:
        assert worker_state(devcluster, namespace, "rolling", pod)["weights_version"] == "b"
        assert complete(devcluster, namespace, pod, prompt, NEW_TOKENS) == expected
    # Replica by replica (maxUnavailable 1): replica 0's update was asked for, and answered, before replica 1's.
    log = devcluster.pod_log(OPERATOR_NS, lease_holder(devcluster), "operator")
    lines = [line for line in log.splitlines() if f"{namespace}/rolling: update weights of" in line]
    assert [line.split("update weights of ")[1].split()[0] for line in lines] == ["rolling-r0-0", "rolling-r1-0"]
    sums_b = {worker_checksum(devcluster, namespace, "rolling", pod) for pod in pods_before}
    assert len(sums_a) == 1 and len(sums_b) == 1 and sums_a != sums_b  # ranks agree, and the weights changed

    # A checkpoint the worker refuses: Degraded with the worker's reason, the roll stopped, b still served.
    patch_spec(devcluster, namespace, "rolling", {"weights": {"version": "broken", "source": "broken"}})
    obj = wait_model(
        devcluster, namespace, "rolling", lambda o: condition(o, "Degraded").get("status") == "True", timeout_s=60,
        what="Degraded",
    )  # fmt: skip
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "WeightsUpdateFailed" and "broken" in degraded["message"], degraded
    assert obj["status"]["weightsVersion"] == "b" and obj["status"]["phase"] == "Degraded"
    assert obj["status"]["weightsRollout"]["failedVersion"] == "broken"
    assert condition(obj, "WeightsSynced")["reason"] == "UpdateFailed"
    for pod in pods_before:
        assert worker_state(devcluster, namespace, "rolling", pod)["weights_version"] == "b"
        assert complete(devcluster, namespace, pod, prompt, NEW_TOKENS) == expected
    assert pod_identity(devcluster, namespace, "rolling") == pods_before

    # Pointing back at a good version clears it.
    patch_spec(devcluster, namespace, "rolling", {"weights": {"version": "b", "source": "tiny-llama-b"}})
    obj = wait_model(devcluster, namespace, "rolling", synced_to("b"), timeout_s=60, what="back to b")
    assert condition(obj, "Degraded")["status"] == "False" and "weightsRollout" not in obj["status"]


GATE = "e2e.tidal.dev/open"


def set_gate(dc: DevCluster, namespace: str, pod: str, open_: bool) -> None:
    """Open or close a pod's readiness gate (the node agent honours gates like the kubelet): a rank that is not ready
    on demand, at once, without freezing or killing its process."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {"type": GATE, "status": "True" if open_ else "False", "lastTransitionTime": now}
    dc.core.patch_namespaced_pod_status(
        pod, namespace, {"status": {"conditions": [cond]}}, _content_type="application/strategic-merge-patch+json"
    )


def test_operator_restart_in_the_middle_of_a_roll_finishes_it_without_repeating(devcluster, namespace, models):
    spec = {
        "replicas": 2,
        "updateStrategy": {"maxUnavailable": 2},
        "worker": {"podTemplate": {"spec": {"readinessGates": [{"conditionType": GATE}]}}},
    }
    create_model(devcluster, namespace, model_manifest("midroll", models, spec))
    for pod in ("midroll-r0-0", "midroll-r1-0"):
        devcluster.wait_pod(namespace, pod, lambda p: p.get("status", {}).get("phase") == "Running", timeout_s=60)
        set_gate(devcluster, namespace, pod, True)
    wait_model(devcluster, namespace, "midroll", phase_is("Ready"), timeout_s=150, what="Ready")
    pods_before = pod_identity(devcluster, namespace, "midroll")

    # Replica 1 goes out of service, so the roll updates replica 0 and must then wait for replica 1.
    set_gate(devcluster, namespace, "midroll-r1-0", False)
    devcluster.wait_pod(namespace, "midroll-r1-0", lambda p: not is_ready(p), timeout_s=30, what="not ready")
    patch_spec(devcluster, namespace, "midroll", {"weights": {"version": "b", "source": "tiny-llama-b"}})

    def ranks(obj: dict) -> dict[str, str | None]:
        return {r["pod"]: r.get("weightsVersion") for r in (obj.get("status") or {}).get("ranks", [])}

    obj = wait_model(
        devcluster, namespace, "midroll", lambda o: ranks(o).get("midroll-r0-0") == "b", timeout_s=60,
        what="replica 0 on b",
    )  # fmt: skip
    assert ranks(obj)["midroll-r1-0"] == "base"
    assert condition(obj, "WeightsSynced")["status"] == "False" and obj["status"]["weightsVersion"] == "base"

    # Restart the operator mid-roll; replica 1 comes back once the old operator is gone for good.
    old = lease_holder(devcluster)
    devcluster.core.delete_namespaced_pod(old, OPERATOR_NS)
    devcluster.wait_pod_gone(OPERATOR_NS, old, timeout_s=60)
    set_gate(devcluster, namespace, "midroll-r1-0", True)

    def new_leader():
        holder = lease_holder(devcluster)
        return next((p for p in operator_pods(devcluster) if p.metadata.name == holder and holder != old), None)

    new = wait_until(new_leader, 90, "a new operator holding the lease")
    obj = wait_model(devcluster, namespace, "midroll", synced_to("b"), timeout_s=120, what="synced to b")
    assert [r["weightsVersion"] for r in obj["status"]["ranks"]] == ["b", "b"]
    assert pod_identity(devcluster, namespace, "midroll") == pods_before

    # The new operator updated replica 1 only: replica 0 had already finished.
    log = devcluster.pod_log(OPERATOR_NS, new.metadata.name, "operator")
    assert "update weights of midroll-r1-0 to b" in log, log
    assert "update weights of midroll-r0-0" not in log, log


def test_idle_timeout_sleeps_the_model_and_a_request_wakes_it(devcluster, namespace, models):
    create_model(devcluster, namespace, model_manifest("idle", models, {"sleep": {"idleTimeoutSeconds": 60}}))
    wait_model(devcluster, namespace, "idle", phase_is("Ready"), timeout_s=120, what="Ready")
    before = complete(devcluster, namespace, "idle-r0-0", PROMPT, NEW_TOKENS)  # starts the worker's idle clock

    obj = wait_model(
        devcluster, namespace, "idle", lambda o: condition(o, "Sleeping").get("status") == "True", timeout_s=120,
        what="asleep for idleness",
    )  # fmt: skip
    assert condition(obj, "Sleeping")["reason"] == "IdleTimeout" and obj["status"]["phase"] == "Sleeping"
    assert worker_state(devcluster, namespace, "idle", "idle-r0-0")["sleep_state"] == "asleep"

    # A request while asleep is refused (503) but counted; the next pass wakes the model.
    ip = devcluster.core.read_namespaced_pod("idle-r0-0", namespace).status.pod_ip
    body = {"model": "idle", "prompt": PROMPT, "max_tokens": 4}
    assert httpx.post(f"http://{ip}:8000/v1/completions", json=body, timeout=30).status_code == 503
    wait_model(devcluster, namespace, "idle", phase_is("Ready"), timeout_s=60, what="woken by the request")
    assert complete(devcluster, namespace, "idle-r0-0", PROMPT, NEW_TOKENS) == before
