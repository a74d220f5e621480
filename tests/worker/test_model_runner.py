"""A StepPlan is plain data that a second rank can execute: it survives JSON, and a follower runner holding the
same weights computes the same logits from it (what a future group's follower will do)."""

from __future__ import annotations

import dataclasses
import json

import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.step_plan import StepPlan, build_step_plan
from tidal.worker.loader.model_loader import load_model
from tidal.worker.testing.hf_reference import prompt_ids

CPU = torch.device("cpu")


def test_follower_runs_the_leaders_plans(tiny_model):
    model_dir = tiny_model("qwen2")
    leader = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=64, block_size=4))
    loaded = load_model(model_dir, "float32", CPU)
    follower = ModelRunner(loaded, CPU, block_size=4)
    follower.allocate_kv_cache(64)
    for i, prompt in enumerate(prompt_ids(model_dir)[:4]):
        leader.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6))
    steps = 0
    while leader.has_unfinished_requests():
        scheduled = leader.scheduler.schedule()
        plan = build_step_plan(scheduled, 4)
        wire = json.dumps(dataclasses.asdict(plan))  # what would travel to a follower
        leader_logits = leader.runner.execute(plan)
        follower_logits = follower.execute(StepPlan(**json.loads(wire)))
        assert (leader_logits is None) == (follower_logits is None)
        if leader_logits is not None:
            assert torch.equal(leader_logits, follower_logits)
        tokens = leader_logits.argmax(-1).tolist() if leader_logits is not None else []
        leader.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
        for item in scheduled.scheduled:
            if item.seq.num_output_tokens >= 6:
                leader.abort_request(item.seq.request_id)
        steps += 1
    assert steps >= 6
