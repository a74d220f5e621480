"""Fixtures for end-to-end tests against a real local control plane (see docs/DEVCLUSTER.md).

One cluster per test session, started by the first test that asks for it and stopped at the end; a fresh
namespace per test. Missing binaries are a failure, not a skip: CI builds them before running the tests.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from operator_e2e import install_operator, write_models

from tidal.devcluster import cluster
from tidal.devcluster.config import CONTROL_PLANE_BINARIES, ClusterConfig, resolve_binaries
from tidal.devcluster.testing import DevCluster

# GPUs the test node advertises: enough for tests that schedule GPU pods; processes only see them if they exist.
E2E_NODE_GPUS = int(os.environ.get("TIDAL_E2E_GPUS", "2"))


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    # die_with_parent: a pytest killed outright (CI timeout, SIGKILL) takes its cluster with it.
    cfg = ClusterConfig(state_dir=tmp_path_factory.mktemp("devcluster"), gpus=E2E_NODE_GPUS, die_with_parent=True)
    try:
        resolve_binaries(cfg, (*CONTROL_PLANE_BINARIES, "helm"))
        missing = ""
    except RuntimeError as exc:
        missing = str(exc)
    if missing:
        pytest.fail(f"e2e tests need the control-plane binaries: {missing}", pytrace=False)
    info = cluster.up(cfg)
    try:
        yield DevCluster(info, cfg)
    finally:
        cluster.down(info.state_dir)


@pytest.fixture
def namespace(devcluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = devcluster.create_namespace(request.node.name.removeprefix("test_"))
    yield name
    devcluster.delete_namespace(name)


@pytest.fixture
def models(devcluster: DevCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart installed and the tiny test models written (both once per session; see operator_e2e)."""
    install_operator(devcluster)
    return write_models(devcluster, tmp_path_factory.getbasetemp() / "tidal-models")


@pytest.fixture
def kubeconfig(devcluster: DevCluster) -> Path:
    return devcluster.kubeconfig


@pytest.fixture
def core(devcluster: DevCluster):
    return devcluster.core


@pytest.fixture
def kubectl(devcluster: DevCluster):
    return devcluster.kubectl


@pytest.fixture
def helm(devcluster: DevCluster):
    return devcluster.helm
