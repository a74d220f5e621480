"""Two operator replicas (helm upgrade --set replicaCount=2) do not fight: one holds the Lease and acts, the other
waits; when the leader's pod goes, the standby takes over and reconciles. Runs last in the session (zz): it moves the
session's operator around."""

import time
from pathlib import Path

import pytest
from operator_e2e import (
    CHART,
    OPERATOR_NS,
    RELEASE,
    create_model,
    install_operator,
    lease_holder,
    model_manifest,
    model_pods,
    operator_pods,
    phase_is,
    wait_model,
    wait_until,
    write_models,
)

from tidal.devcluster.testing import DevCluster, is_ready

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def two_operators(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory):
    install_operator(devcluster)
    models = write_models(devcluster, tmp_path_factory.getbasetemp() / "tidal-models")
    upgrade = ["upgrade", RELEASE, str(CHART), "-n", OPERATOR_NS, "--reuse-values", "--wait", "--timeout", "3m"]
    devcluster.helm(*upgrade, "--set", "replicaCount=2", timeout=240)
    yield models
    devcluster.helm(*upgrade, "--set", "replicaCount=1", timeout=240)


def _ready_operators(dc: DevCluster) -> list:
    pods = operator_pods(dc)
    return pods if len(pods) == 2 and all(is_ready(dc.api_client.sanitize_for_serialization(p)) for p in pods) else []


def test_two_replicas_elect_one_leader_and_fail_over(devcluster, namespace, two_operators: Path):
    pods = wait_until(lambda: _ready_operators(devcluster), 90, "two ready operator pods")
    holder = wait_until(lambda: lease_holder(devcluster), 30, "a lease holder")
    (leader,) = [p for p in pods if p.metadata.name == holder]
    (standby,) = [p for p in pods if p.metadata.name != holder]

    create_model(devcluster, namespace, model_manifest("ha", two_operators))
    wait_model(devcluster, namespace, "ha", phase_is("Ready"), timeout_s=120, what="Ready")
    leader_log = devcluster.pod_log(OPERATOR_NS, leader.metadata.name, "operator")
    standby_log = devcluster.pod_log(OPERATOR_NS, standby.metadata.name, "operator")
    assert f"{namespace}/ha: create pod ha-r0-0" in leader_log
    assert "standby" in standby_log and f"{namespace}/ha" not in standby_log, standby_log

    # The leader goes away: another operator takes the Lease and acts (a deleted rank is recreated by it). That is
    # usually the standby, but the leader releases the Lease as it stops, and the Deployment's replacement pod may
    # take a released Lease before the standby's next poll: both are a correct failover, the old leader is not.
    gone = leader.metadata.name
    deleted_at = time.monotonic()
    devcluster.core.delete_namespaced_pod(gone, OPERATOR_NS)

    def new_leader() -> str | None:
        holder = lease_holder(devcluster)
        return holder if holder not in (None, gone) else None

    try:
        successor = wait_until(new_leader, 60, "another operator holding the lease")
    except TimeoutError as err:
        pods_now = [p.metadata.name for p in operator_pods(devcluster)]
        raise AssertionError(f"{err}: holder {lease_holder(devcluster)!r}, operator pods {pods_now}") from err
    assert successor in [p.metadata.name for p in operator_pods(devcluster)]
    print(f"lease went from {gone} to {successor} in {time.monotonic() - deleted_at:.1f}s")
    old_uid = model_pods(devcluster, namespace, "ha")["ha-r0-0"].metadata.uid
    devcluster.core.delete_namespaced_pod("ha-r0-0", namespace)
    devcluster.wait_pod(
        namespace, "ha-r0-0", lambda p: p["metadata"]["uid"] != old_uid and is_ready(p), timeout_s=90,
        what="recreated by the new leader",
    )  # fmt: skip
    assert f"{namespace}/ha: create pod ha-r0-0" in devcluster.pod_log(OPERATOR_NS, successor, "operator")
