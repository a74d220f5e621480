"""The images `make images` builds are the ones the chart and the CRD's defaults name: same repositories, and the
tag is the project's version, which is also the chart's appVersion."""

import sys
from pathlib import Path

import yaml

from tidal.operator.api.worker_spec import WorkerSpec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack" / "images"))
import spec  # noqa: E402  (hack/images/spec.py, as the builder imports it)

CHART = REPO / "charts" / "tidal"


def test_chart_app_version_is_the_image_tag():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == spec.project_version()
    assert values["image"]["tag"] == ""  # the chart falls back to appVersion


def test_chart_operator_image_is_the_built_one():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == spec.load_spec("tidal-operator").repository


def test_worker_default_image_is_the_built_one():
    worker = spec.load_spec("tidal-worker")
    assert WorkerSpec.model_fields["image"].default == f"{worker.repository}:{spec.project_version()}"


def test_every_image_description_is_valid():
    assert spec.all_image_names() == ["tidal-operator", "tidal-worker"]
    for name in spec.all_image_names():
        assert spec.load_spec(name).name == name
