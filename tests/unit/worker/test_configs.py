"""Validation of SamplingParams and EngineConfig: bad input is refused with a message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", 0, "top_k must be -1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("stop", [""], "must not be empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("seed", -3, "seed must be >= 0"),
    ],
)
def test_sampling_params_rejects(field, value, words):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{field: value})
    assert words in str(err.value)


def test_sampling_params_defaults_and_greedy():
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy
    with pytest.raises(ValidationError):
        SamplingParams(unknown=1)


def test_engine_config_checks():
    EngineConfig(model_path=Path("/m"))
    with pytest.raises(ValidationError, match="power of two"):
        EngineConfig(model_path=Path("/m"), block_size=12)
    with pytest.raises(ValidationError, match="at most one"):
        EngineConfig(model_path=Path("/m"), num_kv_blocks=4, kv_cache_bytes=1024)
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(model_path=Path("/m"), device="tpu")
    with pytest.raises(ValidationError):
        EngineConfig(model_path=Path("/m"), gpu_memory_fraction=0)
    assert EngineConfig(model_path=Path("/x/my-model")).model_name == "my-model"
    for seed in (-1, 2**64):  # else a traceback from torch's generator when the engine is built, not exit code 2
        with pytest.raises(ValidationError, match="seed"):
            EngineConfig(model_path=Path("/m"), seed=seed)


def test_prompt_steps_replay_graphs_by_default_up_to_the_step_size():
    assert EngineConfig(model_path=Path("/m")).prefill_graph_tokens == 2048
    assert EngineConfig(model_path=Path("/m"), max_num_batched_tokens=512).prefill_graph_tokens == 512
    assert EngineConfig(model_path=Path("/m"), cuda_graph_prefill_tokens=0).prefill_graph_tokens == 0
