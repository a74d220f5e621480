"""The examples a newcomer applies are valid for pydantic and for the generated schema, and build pods."""

from pathlib import Path

import pytest
import yaml
from crd_schema_check import check_object

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders.pod import build_pod
from tidal.operator.schema.crd import openapi_schema

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"tiny-model.yaml", "gpu-model.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert check_object(openapi_schema(), doc) == []
        model = InferenceModel.model_validate(doc)
        pod = build_pod(model, 0, 0)
        assert pod["spec"]["containers"][0]["command"][0] == "tidal-worker"


def test_tiny_example_reads_the_host_path_as_is():
    model = InferenceModel.model_validate(yaml.safe_load((EXAMPLES[0].parent / "tiny-model.yaml").read_text()))
    assert build_pod(model, 0, 0)["spec"]["containers"][0]["command"][2] == "/tmp/tidal-models/tiny-llama"
