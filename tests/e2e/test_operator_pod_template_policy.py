"""The chart's podTemplatePolicy on a real API server: with `podTemplatePolicy.restrict=true` a model whose pod
template asks for the node's network (or another escape the policy names) is refused by `kubectl create` with the
policy's message, and a plain model is accepted. The switch is turned off again afterwards, since the chart is
installed once for the whole session."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_e2e import CHART, OPERATOR_NS, RELEASE, get_model, model_manifest, wait_until

from tidal.devcluster.testing import DevCluster

pytestmark = [pytest.mark.e2e]

POLICY = "tidal-operator-pod-template"
HOST_NETWORK_MESSAGE = "spec.worker.podTemplate.spec.hostNetwork: worker pods may not use the node's network"


def _set_restrict(dc: DevCluster, on: bool) -> None:
    dc.helm(
        "upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--reuse-values",
        "--set", f"podTemplatePolicy.restrict={str(on).lower()}", "--wait", "--timeout", "2m",
        timeout=180,
    )  # fmt: skip


@pytest.fixture
def restricted(devcluster: DevCluster, models: Path) -> Iterator[Path]:
    _set_restrict(devcluster, True)
    try:
        yield models
    finally:
        _set_restrict(devcluster, False)


def _create(dc: DevCluster, namespace: str, manifest: dict[str, Any], tmp_path: Path, *extra: str):
    path = tmp_path / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return dc.kubectl("create", "-n", namespace, "-f", str(path), *extra, check=False)


def _with_template(name: str, models: Path, template_spec: dict[str, Any]) -> dict[str, Any]:
    return model_manifest(name, models, {"worker": {"podTemplate": {"spec": template_spec}}})


def test_restricted_chart_refuses_host_network_and_accepts_a_plain_model(devcluster, namespace, restricted, tmp_path):
    host = _with_template("host-net", restricted, {"hostNetwork": True})
    # The API server picks a new policy up from its informer: wait until a dry run (which goes through admission
    # and stores nothing) is refused, before the real create.
    wait_until(
        lambda: HOST_NETWORK_MESSAGE in _create(devcluster, namespace, host, tmp_path, "--dry-run=server").stderr,
        30,
        "the pod-template policy in force",
    )
    refused = _create(devcluster, namespace, host, tmp_path)
    assert refused.returncode != 0, refused.stdout
    assert HOST_NETWORK_MESSAGE in refused.stderr and POLICY in refused.stderr, refused.stderr
    stored = devcluster.kubectl("get", "inferencemodels", "-n", namespace, "-o", "name").stdout
    assert "host-net" not in stored

    # The server's CEL agrees with the unit tests' on the other escapes (dry runs: nothing is stored).
    escapes = {
        "hostPID": {"hostPID": True},
        "securityContext.privileged": {"containers": [{"name": "worker", "securityContext": {"privileged": True}}]},
        "serviceAccountName": {"serviceAccountName": "default"},
        "automountServiceAccountToken": {"automountServiceAccountToken": None},
    }
    for field, template in escapes.items():
        result = _create(
            devcluster, namespace, _with_template("esc", restricted, template), tmp_path, "--dry-run=server"
        )
        assert result.returncode != 0 and POLICY in result.stderr, (field, result.stdout, result.stderr)
        assert field in result.stderr, (field, result.stderr)

    plain = _create(devcluster, namespace, model_manifest("plain", restricted), tmp_path)
    assert plain.returncode == 0, plain.stderr
    # A template that stays inside the pod is untouched by the policy.
    tame = _with_template("tame", restricted, {"hostNetwork": False, "terminationGracePeriodSeconds": 20})
    tame_result = _create(devcluster, namespace, tame, tmp_path)
    assert tame_result.returncode == 0, tame_result.stderr
    assert get_model(devcluster, namespace, "plain")["metadata"]["name"] == "plain"
