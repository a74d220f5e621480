"""Flat flags and TIDAL_* names over nested component configs: unique, mapped back to their component, described."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidal.worker.config import WORKER_OPTIONS, WorkerConfig
from tidal.worker.config_flags import FlatOptions


class _Inner(BaseModel):
    size: int = Field(default=1, ge=1)
    fast: bool = False


class _Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    inner: _Inner = Field(default_factory=_Inner)


def test_two_components_with_one_field_name_are_refused():
    class Other(BaseModel):
        size: int = 2

    class Clashing(BaseModel):
        inner: _Inner
        other: Other

    with pytest.raises(ValueError, match=r"other.size and inner.size both answer to size"):
        FlatOptions(Clashing, env_prefix="X_")


def test_an_alias_that_spells_another_field_is_refused():
    with pytest.raises(ValueError, match="both answer to --size"):
        FlatOptions(_Outer, aliases={"name": ("size",)})


def test_every_worker_field_has_its_flat_names():
    """The contract with the operator, the chart and the docs: TIDAL_<FIELD> and --<field> for every leaf."""
    leaves = {
        name: (component, name)
        for component, model in WorkerConfig.model_fields.items()
        for name in model.annotation.model_fields  # type: ignore[union-attr]
    }
    assert set(WORKER_OPTIONS.options) == set(leaves)
    for name, option in WORKER_OPTIONS.options.items():
        assert option.path == leaves[name]
        assert f"TIDAL_{name.upper()}" in option.env_names
        assert f"--{name.replace('_', '-')}" in option.flags
    model = WORKER_OPTIONS.options["model_path"]
    assert (model.flags, model.env_names) == (("--model", "--model-path"), ("TIDAL_MODEL", "TIDAL_MODEL_PATH"))


def test_names_the_operator_sets_are_worker_options():
    from tidal.operator.api import worker_env

    # Set by the operator for the pod, not read as options: identity, discovery, and where a dying process writes why
    # (read by worker/termination.py before any config exists).
    not_options = {
        worker_env.REPLICA,
        worker_env.POD_NAME,
        worker_env.GROUP_SERVICE,
        worker_env.TERMINATION_MESSAGE_PATH,
    }
    env_names = {n for o in WORKER_OPTIONS.options.values() for n in o.env_names}
    assert set(worker_env.RESERVED_ENV_NAMES) - not_options <= env_names


def test_the_env_pairs_the_crd_refuses_together_are_refused_together_by_the_worker(tmp_path, monkeypatch):
    """`spec.worker.env` may set one of each pair in worker_env.EXCLUSIVE_ENV_NAMES: with both, the worker refuses to
    start (exit code 2), so each pod would crash-loop. Either one alone starts."""
    from tidal.operator.api import worker_env

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("TIDAL_MODEL", str(tmp_path))
    env_names = {n for o in WORKER_OPTIONS.options.values() for n in o.env_names}
    assert worker_env.EXCLUSIVE_ENV_NAMES
    for first, second in worker_env.EXCLUSIVE_ENV_NAMES:
        assert {first, second} <= env_names
        monkeypatch.setenv(first, "64")
        monkeypatch.setenv(second, "1048576")
        with pytest.raises(ValidationError, match="set at most one of"):
            WorkerConfig.from_flat()
        for name in (first, second):
            monkeypatch.delenv(name)
            WorkerConfig.from_flat()
            monkeypatch.setenv(name, "64")
        monkeypatch.delenv(first)
        monkeypatch.delenv(second)


def test_the_crds_weight_dtypes_are_the_workers():
    """`spec.model.weightDtype` reaches the worker as TIDAL_WEIGHT_DTYPE: one set of names on both sides."""
    from tidal.operator.api.spec import WeightDtype
    from tidal.worker.engine.config import EngineConfig, WeightDType
    from tidal.worker.layers.fp8_weights import WEIGHT_DTYPES

    assert get_args(WeightDtype) == get_args(WeightDType) == WEIGHT_DTYPES == ("auto", "fp8")
    assert EngineConfig.model_fields["weight_dtype"].default == "auto"


def test_nest_fills_every_component_and_leaves_unknown_names_on_top():
    options = FlatOptions(_Outer)
    assert options.nest({"name": "a", "size": 3}) == {"name": "a", "inner": {"size": 3}}
    assert options.nest({}) == {"inner": {}}
    assert options.nest({"bogus": 1}) == {"inner": {}, "bogus": 1}


def test_environment_values_are_nested_and_the_first_name_wins():
    options = FlatOptions(_Outer, env_prefix="X_", aliases={"size": ("n",)})
    assert options.from_environ({"X_NAME": "a", "X_N": "4", "X_SIZE": "5", "OTHER": "1"}) == {
        "name": "a",
        "inner": {"size": "4"},
    }


def test_flags_parse_to_flat_names_and_bools_have_a_no_form():
    options = FlatOptions(_Outer, env_prefix="X_")
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    assert vars(parser.parse_args(["--size", "3", "--no-fast"])) == {"size": "3", "fast": False}
    assert vars(parser.parse_args([])) == {}
    help_text = parser.format_help()
    assert "env X_SIZE; default: 1" in help_text and "env X_NAME; required" in help_text


def test_errors_name_the_flag_and_the_variable_of_nested_fields():
    options = FlatOptions(_Outer, env_prefix="X_")
    with pytest.raises(ValidationError) as exc:
        options.build({"size": "0", "bogus": 1})
    lines = options.describe(exc.value)
    assert "--name / X_NAME: Field required" in lines
    assert "--size / X_SIZE: Input should be greater than or equal to 1 (got '0')" in lines
    assert "bogus: Extra inputs are not permitted" in lines


def test_without_a_prefix_there_are_only_flags():
    options = FlatOptions(_Outer)
    with pytest.raises(ValidationError) as exc:
        options.build({})
    assert options.describe(exc.value) == ["--name: Field required"]


def test_the_expert_slot_count_of_a_rank_joining_a_resized_group_is_a_flag_and_a_variable():
    option = WORKER_OPTIONS.options["expert_slots_per_rank"]
    assert option.path == ("engine", "expert_slots_per_rank")
    assert (option.flags, option.env_names) == (("--expert-slots-per-rank",), ("TIDAL_EXPERT_SLOTS_PER_RANK",))
    assert WORKER_OPTIONS.nest({"expert_slots_per_rank": 4})["engine"] == {"expert_slots_per_rank": 4}
