"""The chart in `rbac.scope=namespaces` on a real API server: the operator's ServiceAccount holds its rights in the
watched namespace only, reconciles a model there, and leaves a model elsewhere untouched. The session's install is
switched to one watched namespace and back to cluster scope afterwards (each switch rolls the operator Deployment,
and the new pod takes the leader Lease)."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_e2e import (
    CHART,
    OPERATOR_NS,
    RELEASE,
    create_model,
    get_model,
    model_manifest,
    model_pods,
    phase_is,
    wait_model,
)

from tidal.devcluster.testing import DevCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NS}:tidal-operator"


def _upgrade(dc: DevCluster, scope: str, namespaces: list[str]) -> None:
    dc.helm(
        "upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--reuse-values", "--set", f"rbac.scope={scope}",
        "--set-json", f"watchNamespaces={json.dumps(namespaces)}",
        "--wait", "--timeout", "3m",
        timeout=240,
    )  # fmt: skip


@pytest.fixture
def unwatched(devcluster: DevCluster) -> Iterator[str]:
    name = devcluster.create_namespace("unwatched")
    yield name
    devcluster.delete_namespace(name)


@pytest.fixture
def scoped(devcluster: DevCluster, namespace: str, models: Path) -> Iterator[Path]:
    _upgrade(devcluster, "namespaces", [namespace])
    try:
        yield models
    finally:
        _upgrade(devcluster, "cluster", [])


def _can(dc: DevCluster, verb: str, resource: str, namespace: str) -> bool:
    result = dc.kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", OPERATOR_SA, check=False)
    return result.stdout.strip() == "yes"


def test_namespace_scope_reconciles_the_watched_namespace_only(devcluster, namespace, unwatched, scoped):
    for verb, resource in (("create", "pods"), ("get", "secrets"), ("patch", "inferencemodels")):
        assert _can(devcluster, verb, resource, namespace), (verb, resource)
        assert not _can(devcluster, verb, resource, unwatched), (verb, resource)

    create_model(devcluster, unwatched, model_manifest("elsewhere", scoped))
    create_model(devcluster, namespace, model_manifest("here", scoped))
    wait_model(devcluster, namespace, "here", phase_is("Ready"), timeout_s=120, what="phase Ready")
    # By now the operator has started, listed its namespace and run passes on the resync timer (5 s): a model it
    # watched would have a status and pods.
    assert not get_model(devcluster, unwatched, "elsewhere").get("status")
    assert model_pods(devcluster, unwatched, "elsewhere") == {}
