"""Expert-parallel groups through the operator, on the real control plane with real worker processes: a tiny
Qwen3-MoE with expertParallel 3 forms its group and every rank serves; a deleted rank's pod is replaced while the
survivors serve on, and the group is whole again with the story in its status and events."""

import subprocess
import sys
from pathlib import Path

import pytest
from operator_e2e import (
    complete,
    create_model,
    events_of,
    install_operator,
    model_manifest,
    model_pods,
    wait_model,
    worker_state,
    write_models,
)

from tidal.devcluster.testing import DevCluster
from tidal.operator.api import constants as c

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MOE = "tiny-qwen3-moe"
PROMPT = "The tide comes in and"


@pytest.fixture
def models(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    install_operator(devcluster)
    root = write_models(devcluster, tmp_path_factory.getbasetemp() / "tidal-models")
    if not (root / MOE).exists():
        subprocess.run(
            [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "qwen3_moe", "--out", str(root / MOE)],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    return root


def _group(obj: dict) -> dict:
    groups = obj.get("status", {}).get("groups") or [{}]
    return groups[0]


def _whole(after_epoch: int):
    def check(obj: dict) -> bool:
        group = _group(obj)
        return (
            group.get("members") == [0, 1, 2] and group.get("epoch", 0) > after_epoch and group.get("state") == "Whole"
        )

    return check


@pytest.mark.parametrize("lost", [1, 0])  # 0: the first epoch's coordinator, so the survivors need another
def test_a_group_forms_serves_on_every_rank_and_recovers_from_a_deleted_rank(devcluster, namespace, models, lost):
    spec = {
        "model": {"path": MOE},
        "expertParallel": 3,
        "experts": {"redundantExpertsPerRank": 1, "collectiveTimeoutSeconds": 2},
    }
    create_model(devcluster, namespace, model_manifest("moe", models, spec))
    obj = wait_model(devcluster, namespace, "moe", _whole(0), timeout_s=300, what="the group whole")
    first_epoch = _group(obj)["epoch"]
    pods = model_pods(devcluster, namespace, "moe")
    assert sorted(pods) == ["moe-r0-0", "moe-r0-1", "moe-r0-2"]
    reference = complete(devcluster, namespace, "moe-r0-0", PROMPT, 16)
    for name in pods:  # every rank is a serving endpoint, with the same answer
        assert complete(devcluster, namespace, name, PROMPT, 16) == reference
        assert pods[name].metadata.labels[c.LABEL_SERVING] == "true"
        state = worker_state(devcluster, namespace, "moe", name)
        assert state["group"]["health"] == "serving" and state["group"]["members"] == [0, 1, 2]

    victim = f"moe-r0-{lost}"
    old_uid = pods[victim].metadata.uid
    devcluster.core.delete_namespaced_pod(victim, namespace)
    # The survivors serve while the replacement loads; then the group is whole again at a later epoch.
    assert complete(devcluster, namespace, "moe-r0-2", PROMPT, 16) == reference
    obj = wait_model(devcluster, namespace, "moe", _whole(first_epoch + 1), timeout_s=300, what="whole again")
    assert model_pods(devcluster, namespace, "moe")[victim].metadata.uid != old_uid
    recovery = _group(obj)["lastRecovery"]
    assert recovery["failedRanks"] == [lost] and recovery["survivorsEpoch"] > first_epoch
    assert recovery["wholeAt"] is not None and recovery["interruptionSeconds"] is not None
    for name in ("moe-r0-0", "moe-r0-1", "moe-r0-2"):
        assert complete(devcluster, namespace, name, PROMPT, 16) == reference
    reasons = {e.reason for e in events_of(devcluster, namespace, "moe")}
    assert {"RankFailed", "GroupReconfigured", "RankRejoined"} <= reasons, reasons
