"""Every invalid object in the shared table is refused by the real API server (with the chart's CRD), with its
message and the field it names, as `kubectl create` prints it. Nothing is created."""

import json
import sys
from pathlib import Path

import pytest
from operator_e2e import install_operator

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "operator"))
from invalid_objects import CASES

pytestmark = pytest.mark.e2e


def test_at_least_ten_cases():
    assert len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_api_server_refuses(devcluster, case, tmp_path):
    install_operator(devcluster)  # the CRD comes with the chart
    obj = case.build()
    obj["metadata"]["namespace"] = "default"
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(obj))
    result = devcluster.kubectl("create", "-f", str(path), check=False)
    assert result.returncode != 0, f"{case.id} was accepted: {result.stdout}"
    assert case.apiserver_error in result.stderr, result.stderr
    assert case.field in result.stderr, result.stderr
    # Every error of ours names its field. The API server's own note that it skipped the CEL rules of an object with
    # schema errors has no field (it prints `<nil>:` too); it is not a rule of ours.
    skipped_rules = "some validation rules were not checked"
    unnamed = [line for line in result.stderr.splitlines() if "<nil>" in line and skipped_rules not in line]
    assert not unnamed, result.stderr
    listed = devcluster.kubectl("get", "inferencemodels.tidal.dev", "-n", "default", "-o", "name").stdout
    assert listed.strip() == ""
