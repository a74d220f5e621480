"""Every invalid object is refused by the pydantic model and by the generated CRD schema, with the same reason."""

import pytest
from crd_schema_check import check_object
from invalid_objects import ACCEPTED_VARIANTS, CASES, VALID, build_variant
from pydantic import ValidationError

from tidal.operator.api.resource import InferenceModel
from tidal.operator.api.spec import ModelVolume
from tidal.operator.builders.weights import mount_path
from tidal.operator.schema.crd import openapi_schema

SCHEMA = openapi_schema()


def test_the_table_is_large_enough_and_ids_are_unique():
    assert len(CASES) >= 10
    assert len({c.id for c in CASES}) == len(CASES)


def test_base_object_is_valid_for_both():
    InferenceModel.model_validate(VALID)
    assert check_object(SCHEMA, VALID) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pydantic_refuses(case):
    with pytest.raises(ValidationError) as err:
        InferenceModel.model_validate(case.build())
    assert case.pydantic_error in str(err.value)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_generated_schema_refuses(case):
    errors = check_object(SCHEMA, case.build())
    assert errors, f"schema accepted {case.id}"
    joined = "\n".join(errors)
    assert case.apiserver_error in joined
    assert any(e.startswith(f".{case.field}:") for e in errors), errors
    assert not any(e.startswith("<nil>") for e in errors), "a rule without a field: kubectl would print <nil>"


@pytest.mark.parametrize("changes", ACCEPTED_VARIANTS.values(), ids=ACCEPTED_VARIANTS.keys())
def test_near_misses_stay_valid_for_both(changes):
    obj = build_variant(changes)
    InferenceModel.model_validate(obj)
    assert check_object(SCHEMA, obj) == []


@pytest.mark.parametrize(
    "volume",
    [
        {"hostPath": {"path": "/srv/models"}},
        {"hostPath": {"path": "/srv/models"}, "mountPath": "/m"},
        {"persistentVolumeClaim": {"claimName": "models"}},
        {"persistentVolumeClaim": {"claimName": "models"}, "mountPath": "/m"},
    ],
)
def test_the_root_mount_rule_sees_the_mount_path_the_pod_gets(volume):
    parsed = ModelVolume.model_validate(volume)
    assert parsed.mounted_at() == mount_path(parsed)


@pytest.mark.parametrize("level", [1.0, 2.0])
def test_a_sleep_level_written_as_a_float_reaches_the_operator_as_an_integer(level):
    # The API server takes a JSON 1.0 for an integer field and stores 1; were a 1.0 to reach the operator, its model
    # would still read the integer (the level is sent to the worker's control API as it is).
    parsed = InferenceModel.model_validate(build_variant({"spec.sleep": {"level": level}}))
    assert type(parsed.spec.sleep.level) is int and parsed.spec.sleep.level == level
