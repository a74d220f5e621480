"""The profiled forwards behind the KV cache's sizing on CUDA (engine_setup.decide_num_kv_blocks), counted on a
stand-in runner: what each profile costs is a forward at start, so none runs twice."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal.worker.engine import engine_setup
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.model_runner import ModelRunner


class ProfilingRunner:
    """As much of ModelRunner as the sizing touches; its estimate is ModelRunner's own."""

    device = torch.device("cuda")  # a device object only: nothing is allocated on it
    bytes_per_block = 2**20
    dtype = torch.bfloat16
    estimate_graph_pool = ModelRunner.estimate_graph_pool

    def __init__(self) -> None:
        self.model = SimpleNamespace(hidden_size=64)
        self.graph_pool_estimate_bytes = 0
        self.profiled: list[tuple[int, int]] = []

    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
        self.profiled.append((num_tokens, num_seqs))
        return 1000 * num_tokens  # peak activation bytes grow with the step's tokens


@pytest.fixture
def free_memory(monkeypatch):
    monkeypatch.setattr(engine_setup, "gpu_kv_cache_bytes", lambda device, fraction, held_back=0: 2**30 - held_back)


def sized(**config) -> ProfilingRunner:
    runner = ProfilingRunner()
    engine_config = EngineConfig(model_path=Path("/m"), max_num_seqs=8, **config)
    engine_setup.decide_num_kv_blocks(engine_config, runner, max_model_len=4096)  # type: ignore[arg-type]
    return runner


def test_the_default_largest_prompt_graph_is_the_sizing_step_profiled_once(free_memory):
    runner = sized()  # prompt graphs up to max_num_batched_tokens, 2048 both
    assert runner.profiled == [(2048, 8), (8, 8)]  # the step of the most tokens, then the largest decode graph
    assert runner.graph_pool_estimate_bytes > 2048 * 1000  # from the first profile's peak


def test_smaller_prompt_graphs_profile_their_own_step(free_memory):
    assert sized(cuda_graph_prefill_tokens=512).profiled == [(2048, 8), (8, 8), (512, 8)]
    assert sized(cuda_graph_prefill_tokens=0).profiled == [(2048, 8), (8, 8)]
    assert sized(enforce_eager=True).profiled == [(2048, 8)]
