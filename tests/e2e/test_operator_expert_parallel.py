"""Expert-parallel groups through the operator, on the real control plane with real worker processes, under load.

One tiny Qwen3-MoE with expertParallel 3 and a redundant expert slot per rank serves for the whole module; the tests
run in order, each starting from the whole group and leaving it whole. Eight client threads send greedy completions
through the model's Service (the official `openai` client over the Service's ready endpoints, its own retries on)
while a rank is deleted, crashed (SIGKILL), frozen (SIGSTOP), or lost with the operator killed mid-recovery. Every
request must end with the reference text; attempts may fail only on the failed rank, and the client's retries must
have carried some of its requests over to the survivors. The operator replaces the rank and reforms the whole group,
and its status, Events and `kubectl describe` tell the story.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from operator_e2e import (
    OPERATOR_NS,
    complete,
    condition,
    create_model,
    events_of,
    get_model,
    install_operator,
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
    write_models,
)

from tidal.devcluster.service_endpoints import BalancingTransport, ServiceEndpoints
from tidal.devcluster.service_load import LoadReport, ServiceLoad
from tidal.devcluster.testing import DevCluster
from tidal.operator.api import constants as c
from tidal.operator.builders.names import serving_service_name

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MOE = "tiny-qwen3-moe"
MOE_B = "tiny-qwen3-moe-b"  # the same architecture, another seed: a weight version to roll to
NAME = "moe"
RANKS = 3
PROMPT = "The tide comes in and"
MAX_TOKENS = 16
STREAMS = 8
WHOLE_TIMEOUT_S = 300


@dataclass
class Group:
    namespace: str
    reference: str
    endpoints: ServiceEndpoints

    def pod(self, rank: int) -> str:
        return f"{NAME}-r0-{rank}"

    @property
    def pods(self) -> set[str]:
        return {self.pod(r) for r in range(RANKS)}


def _group_status(obj: dict[str, Any]) -> dict[str, Any]:
    groups = obj.get("status", {}).get("groups") or [{}]
    return groups[0]


def _whole(after_epoch: int, size: int = RANKS) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        group = _group_status(obj)
        members_ok = group.get("members") == list(range(size))
        return members_ok and group.get("epoch", 0) > after_epoch and group.get("state") == "Whole"

    return check


@pytest.fixture(scope="module")
def moe(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    install_operator(devcluster)
    root = write_models(devcluster, tmp_path_factory.getbasetemp() / "tidal-models")
    for name, seed in ((MOE, 0), (MOE_B, 7)):
        if not (root / name).exists():
            subprocess.run(
                [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "qwen3_moe", "--out",
                 str(root / name), "--seed", str(seed)],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
    namespace = devcluster.create_namespace("expert-parallel")
    spec = {
        "model": {"path": MOE},
        "expertParallel": RANKS,
        "experts": {"redundantExpertsPerRank": 1, "collectiveTimeoutSeconds": 2},
    }
    create_model(devcluster, namespace, model_manifest(NAME, root, spec))
    wait_model(devcluster, namespace, NAME, _whole(0), timeout_s=WHOLE_TIMEOUT_S, what="the group whole")
    endpoints = ServiceEndpoints(devcluster.api_client, namespace, serving_service_name(NAME))
    group = Group(namespace, complete(devcluster, namespace, f"{NAME}-r0-0", PROMPT, MAX_TOKENS), endpoints)
    try:
        endpoints.wait_for(group.pods, timeout_s=60)
        yield group
    finally:
        endpoints.stop()
        devcluster.delete_namespace(namespace)


@dataclass
class Recovery:
    report: LoadReport
    model: dict[str, Any]
    new_events: list[Any]


def _recover_under_load(
    dc: DevCluster, group: Group, victim: int, fault: Callable[[], None], interruption_known: bool = True
) -> Recovery:
    """Start the load, apply `fault` to rank `victim`, wait for the group to be whole again with the load still
    flowing on every rank, and return what the clients saw, the model, and the Events posted since the fault.
    `interruption_known=False`: the fault may keep any operator from seeing the failure (the recovery is then found
    from the epochs, its interruption unknown)."""
    before = _group_status(get_model(dc, group.namespace, NAME))
    seen_events = {e.metadata.name for e in events_of(dc, group.namespace, NAME)}
    old_uid = model_pods(dc, group.namespace, NAME)[group.pod(victim)].metadata.uid
    transport = BalancingTransport(group.endpoints)
    load = ServiceLoad(transport, NAME, PROMPT, MAX_TOKENS, group.reference, streams=STREAMS).start()
    load.wait_for_requests(2 * STREAMS, timeout_s=120)
    fault()
    # The survivors' epoch, then the whole group's: at least two epochs later.
    obj = wait_model(dc, group.namespace, NAME, _whole(before["epoch"] + 1), WHOLE_TIMEOUT_S, "whole again")
    group.endpoints.wait_for(group.pods, timeout_s=60)
    load.wait_for_requests(2 * STREAMS, timeout_s=120)  # the whole group serves the load again
    report = load.stop(victims={group.pod(victim)})
    new_events = [e for e in events_of(dc, group.namespace, NAME) if e.metadata.name not in seen_events]
    story = "\n".join(f"{e.reason}: {e.message}" for e in new_events) + "\n" + _operator_story(dc, group)
    summary = report.summary()
    told = f"{summary}\n{story}"
    assert not report.survivor_losses, told
    assert len(report.completed) == len(report.records), told
    recovery = _group_status(obj).get("lastRecovery") or {}
    assert recovery.get("failedRanks") == [victim] and recovery["failedEpoch"] >= before["epoch"], f"{recovery}\n{told}"
    assert recovery["survivorsEpoch"] > recovery["failedEpoch"] and recovery["wholeAt"] is not None, recovery
    assert recovery.get("interruptionSeconds") is not None or not interruption_known, recovery
    reasons = {e.reason for e in new_events}
    assert {"RankFailed", "GroupReconfigured", "RankRejoined"} <= reasons, reasons
    assert any(e.reason == "RankFailed" and f"rank {victim}:" in e.message for e in new_events)
    pods = model_pods(dc, group.namespace, NAME)
    for rank in range(RANKS):  # every rank serves again, with the same answer, in the group's epoch
        assert pods[group.pod(rank)].metadata.labels[c.LABEL_SERVING] == "true"
        assert complete(dc, group.namespace, group.pod(rank), PROMPT, MAX_TOKENS) == group.reference
        state = worker_state(dc, group.namespace, NAME, group.pod(rank))
        assert state["group"]["health"] == "serving" and state["group"]["members"] == list(range(RANKS))
    print(f"\nrank {victim}: {summary}; lastRecovery {recovery}; old pod uid {old_uid}")
    return Recovery(report, obj, new_events)


def _operator_story(dc: DevCluster, group: Group) -> str:
    """The operator's log lines about this model's group (for failure messages)."""
    lines = []
    for pod in operator_pods(dc):
        log = dc.pod_log(OPERATOR_NS, pod.metadata.name, "operator")
        lines += [line for line in log.splitlines() if f"{group.namespace}/{NAME}" in line]
    for name, pod in sorted(model_pods(dc, group.namespace, NAME).items()):
        restarts = sum(s.restart_count for s in pod.status.container_statuses or [])
        lines.append(f"{name}: uid {pod.metadata.uid}, {restarts} restarts")
        if restarts:
            lines += dc.pod_log(group.namespace, name, "worker", previous=True).splitlines()[-25:]
    return "\n".join(lines[-120:])


def _pod_uid(dc: DevCluster, group: Group, rank: int) -> str:
    return model_pods(dc, group.namespace, NAME)[group.pod(rank)].metadata.uid


def _pod_incarnation(dc: DevCluster, group: Group, rank: int) -> tuple[str, int]:
    """(pod uid, container restarts) of a rank's pod."""
    pod = model_pods(dc, group.namespace, NAME)[group.pod(rank)]
    return pod.metadata.uid, sum(s.restart_count for s in pod.status.container_statuses or [])


def test_a_formed_group_serves_the_same_answer_on_every_rank(devcluster, moe):
    pods = model_pods(devcluster, moe.namespace, NAME)
    assert set(pods) == moe.pods
    for name in sorted(moe.pods):
        assert pods[name].metadata.labels[c.LABEL_SERVING] == "true"
        assert complete(devcluster, moe.namespace, name, PROMPT, MAX_TOKENS) == moe.reference


def test_a_deleted_rank_is_replaced_while_the_survivors_serve(devcluster, moe):
    uid = _pod_uid(devcluster, moe, 1)
    out = _recover_under_load(
        devcluster, moe, 1, lambda: devcluster.kubectl("delete", "pod", moe.pod(1), "-n", moe.namespace, "--wait=false")
    )
    assert _pod_uid(devcluster, moe, 1) != uid
    described = devcluster.kubectl("describe", "inferencemodel", NAME, "-n", moe.namespace).stdout
    for text in ("Last Recovery", "Failed Ranks", "RankFailed", "GroupReconfigured", "RankRejoined"):
        assert text in described, described
    listed = devcluster.kubectl("get", "inferencemodel", NAME, "-n", moe.namespace).stdout
    assert "GROUPS" in listed and "Whole @" in listed, listed
    assert out.report.failed_attempts.keys() <= {moe.pod(1)}


def test_a_crashed_rank_reloads_in_place_and_its_requests_are_retried(devcluster, moe):
    uid = _pod_uid(devcluster, moe, 2)
    out = _recover_under_load(devcluster, moe, 2, lambda: devcluster.inject_fault(moe.namespace, moe.pod(2), "crash"))
    # The container restarted in its pod; nothing was deleted.
    assert _pod_uid(devcluster, moe, 2) == uid, _operator_story(devcluster, moe)
    assert out.report.retried_ok, out.report.summary()  # its requests in flight went to the survivors on retry


def test_a_frozen_rank_is_named_by_its_peers_and_replaced(devcluster, moe):
    before = _pod_incarnation(devcluster, moe, 1)
    out = _recover_under_load(devcluster, moe, 1, lambda: devcluster.inject_fault(moe.namespace, moe.pod(1), "freeze"))
    # A frozen process never comes back by itself: the operator deleted its pod (a replacement was made), or its
    # liveness probe restarted the container first (the operator then leaves a recently restarted rank to reload in
    # place). Which one comes first is a matter of timing; either way the frozen process is gone.
    (uid, restarts), (new_uid, new_restarts) = before, _pod_incarnation(devcluster, moe, 1)
    assert new_uid != uid or new_restarts > restarts, _operator_story(devcluster, moe)
    assert out.report.retried_ok, out.report.summary()
    failed = next(e for e in out.new_events if e.reason == "RankFailed")
    assert "broken by it" in failed.message or "has not answered" in failed.message, failed.message


def test_losing_the_coordinator_hands_the_group_to_a_survivor(devcluster, moe):
    first_coordinator = _group_status(get_model(devcluster, moe.namespace, NAME))["coordinatorRank"]
    victim = first_coordinator
    out = _recover_under_load(
        devcluster, moe, victim, lambda: devcluster.core.delete_namespaced_pod(moe.pod(victim), moe.namespace)
    )
    survivors = _group_status(out.model)["lastRecovery"]
    assert survivors["failedRanks"] == [victim]


def _operator_restarts(dc: DevCluster) -> int:
    return sum(s.restart_count for p in operator_pods(dc) for s in p.status.container_statuses or [])


def test_an_operator_killed_mid_recovery_resumes_it(devcluster, moe):
    (operator,) = operator_pods(devcluster)
    restarts = _operator_restarts(devcluster)

    def crash_rank_then_the_operator() -> None:
        devcluster.inject_fault(moe.namespace, moe.pod(1), "crash")
        time.sleep(0.5)  # the survivors' epoch may or may not be out: either way the next operator must finish
        devcluster.inject_fault(OPERATOR_NS, operator.metadata.name, "crash")

    # The operator may die before it records the failure, and its next process find the survivors' epoch out.
    _recover_under_load(devcluster, moe, 1, crash_rank_then_the_operator, interruption_known=False)
    # The recovery was finished by the operator's next process (the crash restarted its container in place).
    wait_until(lambda: _operator_restarts(devcluster) > restarts, timeout_s=30, what="the operator restarted")


def test_resizing_3_to_4_to_3_under_load_restarts_no_rank_that_stays(devcluster, moe):
    before = pod_identity(devcluster, moe.namespace, NAME)
    epoch = _group_status(get_model(devcluster, moe.namespace, NAME))["epoch"]
    load = ServiceLoad(
        BalancingTransport(moe.endpoints), NAME, PROMPT, MAX_TOKENS, moe.reference, streams=STREAMS
    ).start()
    load.wait_for_requests(2 * STREAMS, timeout_s=120)
    patch_spec(devcluster, moe.namespace, NAME, {"expertParallel": RANKS + 1})
    grown = wait_model(devcluster, moe.namespace, NAME, _whole(epoch, RANKS + 1), WHOLE_TIMEOUT_S, "grown to 4")
    moe.endpoints.wait_for(moe.pods | {moe.pod(RANKS)}, timeout_s=60)
    load.wait_for_requests(2 * STREAMS, timeout_s=120)
    assert complete(devcluster, moe.namespace, moe.pod(RANKS), PROMPT, MAX_TOKENS) == moe.reference
    patch_spec(devcluster, moe.namespace, NAME, {"expertParallel": RANKS})
    shrunk = _group_status(grown)["epoch"]
    wait_model(devcluster, moe.namespace, NAME, _whole(shrunk, RANKS), WHOLE_TIMEOUT_S, "back to 3")
    moe.endpoints.wait_for(moe.pods, timeout_s=60)
    load.wait_for_requests(2 * STREAMS, timeout_s=120)
    report = load.stop(victims={moe.pod(RANKS)})  # the rank that leaves may cut its requests; they are retried
    told = f"{report.summary()}\n{_operator_story(devcluster, moe)}"
    assert not report.survivor_losses and len(report.completed) == len(report.records), told
    wait_until(lambda: moe.pod(RANKS) not in model_pods(devcluster, moe.namespace, NAME), 60, "rank 3's pod gone")
    after = pod_identity(devcluster, moe.namespace, NAME)
    assert after == before, told  # ranks 0-2: the same pods, never restarted
    for rank in range(RANKS):
        assert worker_state(devcluster, moe.namespace, NAME, moe.pod(rank))["group"]["group_size"] == RANKS


def test_the_group_sleeps_and_wakes_whole(devcluster, moe):
    epoch = _group_status(get_model(devcluster, moe.namespace, NAME))["epoch"]
    patch_spec(devcluster, moe.namespace, NAME, {"sleep": {"state": "Asleep"}})
    obj = wait_model(
        devcluster, moe.namespace, NAME, lambda o: condition(o, "Sleeping").get("status") == "True", timeout_s=120,
        what="Sleeping=True",
    )  # fmt: skip
    assert [r["state"] for r in obj["status"]["ranks"]] == ["Asleep"] * RANKS
    for rank in range(RANKS):
        assert worker_state(devcluster, moe.namespace, NAME, moe.pod(rank))["sleep_state"] == "asleep"
    patch_spec(devcluster, moe.namespace, NAME, {"sleep": {"state": "Awake"}})
    obj = wait_model(devcluster, moe.namespace, NAME, phase_is("Ready"), timeout_s=120, what="Ready after the wake")
    assert _group_status(obj)["state"] == "Whole" and _group_status(obj)["epoch"] >= epoch
    for rank in range(RANKS):
        assert complete(devcluster, moe.namespace, moe.pod(rank), PROMPT, MAX_TOKENS) == moe.reference


def test_a_weight_roll_updates_the_whole_group_in_place(devcluster, moe):
    pods_before = {n: p.metadata.uid for n, p in model_pods(devcluster, moe.namespace, NAME).items()}
    sums_a = {worker_checksum(devcluster, moe.namespace, NAME, moe.pod(r)) for r in range(RANKS)}
    patch_spec(devcluster, moe.namespace, NAME, {"weights": {"version": "b", "source": MOE_B}})
    obj = wait_model(devcluster, moe.namespace, NAME, synced_to("b"), timeout_s=180, what="synced to b")
    assert [r["weightsVersion"] for r in obj["status"]["ranks"]] == ["b"] * RANKS
    assert {n: p.metadata.uid for n, p in model_pods(devcluster, moe.namespace, NAME).items()} == pods_before
    # Each rank's checksum covers its own experts, so ranks differ; every one changed with the version.
    sums_b = {worker_checksum(devcluster, moe.namespace, NAME, moe.pod(r)) for r in range(RANKS)}
    assert not sums_a & sums_b
    texts = {complete(devcluster, moe.namespace, moe.pod(r), PROMPT, MAX_TOKENS) for r in range(RANKS)}
    assert len(texts) == 1 and texts != {moe.reference}, texts  # the group serves b, on every rank alike
    assert _group_status(obj)["state"] == "Whole"
