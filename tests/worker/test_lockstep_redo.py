"""A lockstep step whose group breaks during its forward is run again on the next epoch: greedy outputs are exactly
those of a run without the fault, whichever collective of whichever step (prefill chunk or decode) failed.

One process, one rank: the group is a loopback comm (a group of one, holding every expert in its slots) that raises
GroupBrokenError at a chosen collective, as a real epoch's group does when a peer dies mid-step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.experts.placement import plan_placement
from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM
from tidal.worker.testing.hf_reference import prompt_ids

MAX_TOKENS = 12


class FlakyLoopback:
    """A group of one (every row goes to this rank) whose `fail_at`-th collective raises, once."""

    members = (0,)
    group_rank = 0
    size = 1

    def __init__(self, fail_at: int | None) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise GroupBrokenError("rank 1 is gone (connection refused)", peer_rank=1, epoch=1)

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        self._count()
        return counts.clone()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        self._count()
        return send.clone()


def _engine(model_dir: Path, comm: FlakyLoopback) -> LLMEngine:
    # world_size 2 with 4 redundant slots: 8 slots, so rank 0 alone can hold all 8 experts (an epoch of one).
    config = EngineConfig(
        model_path=model_dir, dtype="float32", device="cpu", num_kv_blocks=64, world_size=2,
        redundant_experts_per_rank=4, max_num_batched_tokens=24,  # long prompts take several prefill chunks
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    model = engine.runner.model
    assert isinstance(model, MoeDecoderForCausalLM) and model.expert_parallel is not None
    state = model.expert_parallel
    epoch_map = plan_placement(state.shape, [0], state.expert_map).expert_map
    model.install_expert_epoch(epoch_map, state.changes_to(epoch_map), comm, model_dir)
    assert not engine.config.async_scheduling  # expert parallelism steps one at a time
    return engine


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], int]:
    """Every prompt to the end through group_step, the group "reconfigured" after each break -> (tokens, breaks)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    breaks = 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.group_step()
        except GroupBrokenError:
            breaks += 1  # the survivors' next epoch: the same comm stands for it here
            continue
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens, breaks


@pytest.mark.parametrize("fail_at", [1, 7, 30])  # the first collective, one in a later layer, one in a later step
def test_a_step_broken_mid_forward_is_redone_and_outputs_do_not_change(tiny_model, fail_at):
    model_dir = tiny_model("qwen3_moe")
    prompts = prompt_ids(model_dir)
    expected, no_breaks = _run(_engine(model_dir, FlakyLoopback(None)), prompts)
    assert no_breaks == 0
    comm = FlakyLoopback(fail_at)
    got, breaks = _run(_engine(model_dir, comm), prompts)
    assert breaks == 1 and comm.calls > fail_at
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got.values())


def test_an_empty_step_runs_every_moe_layer_on_no_tokens(tiny_model):
    comm = FlakyLoopback(None)
    engine = _engine(tiny_model("qwen3_moe"), comm)
    assert engine.group_step() == []  # nothing of its own: its MoE layers still take part
    model = engine.runner.model
    assert isinstance(model, MoeDecoderForCausalLM)
    assert comm.calls == 3 * len(model.expert_layers)  # counts, rows out, results back: per MoE layer


def test_the_warm_up_runs_steps_with_the_rank_alone_and_installs_no_epoch(tiny_model):
    config = EngineConfig(
        model_path=tiny_model("qwen3_moe"), dtype="float32", device="cpu", num_kv_blocks=64, world_size=4
    )
    engine = LLMEngine.from_config(config)
    model = engine.runner.model
    assert isinstance(model, MoeDecoderForCausalLM) and model.expert_parallel is not None
    state = model.expert_parallel
    with state.warm_up_alone(engine.runner.device):
        engine.runner.profile(24, 4, engine.max_model_len)  # a prefill and a decode shape, every MoE layer alone
        engine.runner.profile(3, 3, engine.max_model_len)
        with pytest.raises(RuntimeError, match="before the first epoch"), state.warm_up_alone(engine.runner.device):
            pass
    assert state.comm is None and state.routing is None  # still waiting for its first epoch
