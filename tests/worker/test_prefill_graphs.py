"""Prompt-step CUDA graphs' padding (worker/engine/prefill_graphs.py), checked on CPU: the static inputs a graph
replays, filled from real mixed plans and padded to their bucket, give the eager step's logits and leave the eager
step's KV cache (its own K/V written, nothing else). The capture itself needs a GPU (tests/worker/test_engine_cuda.py
and test_async_scheduling_cuda.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.prefill_graphs import PrefillGraphs, token_buckets
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.sequence import UNKNOWN_TOKEN
from tidal.worker.engine.step_plan import StepPlan, build_step_plan
from tidal.worker.testing.hf_reference import prompt_ids

BLOCK_SIZE = 4
MAX_TOKENS = 40  # prompt chunks and decodes share steps of up to this many tokens


def test_token_buckets():
    assert token_buckets(2048)[:6] == [16, 32, 64, 128, 256, 384]
    assert token_buckets(2048)[-2:] == [1920, 2048]
    assert token_buckets(1000)[-2:] == [896, 1000]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]
    with pytest.raises(ValueError, match="at least 1"):
        token_buckets(0)


def padded_logits(engine: LLMEngine, graphs: PrefillGraphs, plan: StepPlan, previous=None) -> torch.Tensor | None:
    """What the runner returns for `plan` through the graphs' inputs, with the forward run eagerly (no replay)."""
    size = graphs.prepare(plan, previous)
    tokens, seqs = plan.num_tokens, plan.num_seqs
    assert size == graphs.size_for(tokens) >= tokens
    # The layout the Triton kernel relies on (the CPU reference would also tolerate tokens of no sequence): the
    # padding tokens are one more sequence, without context, and write nothing; the sequences after it are empty.
    assert graphs.cu_seqlens_q.tolist() == [*plan.cu_seqlens_q, *[size] * (graphs.max_num_seqs + 1 - seqs)]
    assert graphs.seq_lens.tolist() == [*plan.seq_lens, *[0] * (graphs.max_num_seqs + 1 - seqs)]
    assert graphs.slot_mapping[tokens:size].eq(-1).all()
    hidden = graphs.forward(size)[: plan.num_tokens]
    return engine.runner._logits(hidden, plan)


def caches(engine: LLMEngine) -> list[torch.Tensor]:
    return [cache for pair in engine.runner.kv_caches for cache in pair]


def caches_copy(engine: LLMEngine) -> list[torch.Tensor]:
    return [cache.clone() for cache in caches(engine)]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen2_moe"])
def test_padded_prompt_steps_give_the_eager_logits(tiny_model, arch):
    model_dir = tiny_model(arch)
    config = EngineConfig(
        model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=128, block_size=BLOCK_SIZE,
        max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS, async_scheduling=False,
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    runner = engine.runner
    max_blocks = engine.max_model_len // BLOCK_SIZE
    graphs = PrefillGraphs(runner.model, runner.kv_caches, runner.device, 4, max_blocks, MAX_TOKENS)
    for i, prompt in enumerate(prompt_ids(model_dir)[:6]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=5))
    padded_steps = mixed_steps = 0
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        plan = build_step_plan(scheduled, BLOCK_SIZE)
        if plan.is_decode_only:
            logits = runner.execute(plan)
        else:
            assert graphs.can_run(plan)
            before = caches_copy(engine)
            got = padded_logits(engine, graphs, plan)  # first, from the cache as the step finds it
            graphed = caches_copy(engine)
            for cache, saved in zip(caches(engine), before, strict=True):
                cache.copy_(saved)
            logits = runner.execute(plan)  # eager, from the same cache
            # The step's own K/V written, and nothing else.
            for eager, padded in zip(caches(engine), graphed, strict=True):
                torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
            assert (got is None) == (logits is None)
            if logits is not None:
                torch.testing.assert_close(got, logits, atol=1e-4, rtol=1e-4)
                assert torch.equal(got.argmax(-1), logits.argmax(-1))
            padded_steps += graphs.size_for(plan.num_tokens) > plan.num_tokens
            mixed_steps += any(b - a == 1 for a, b in zip(plan.cu_seqlens_q, plan.cu_seqlens_q[1:], strict=False))
        tokens = logits.argmax(-1).tolist() if logits is not None else []
        engine.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
        for item in scheduled.scheduled:  # the scheduler alone does not stop a sequence
            if item.seq.num_output_tokens >= 5:
                engine.abort_request(item.seq.request_id)
    assert padded_steps >= 2 and mixed_steps >= 1  # the schedule did pad, and did mix decodes with prompt chunks


def test_unknown_inputs_come_from_the_previous_step(tiny_model):
    """Async scheduling: a decode row's input is the previous step's sampled token, gathered on the device."""
    model_dir = tiny_model("qwen3")
    engine = LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
                     max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS, async_scheduling=False)
    )  # fmt: skip
    runner = engine.runner
    graphs = PrefillGraphs(runner.model, runner.kv_caches, runner.device, 4, 64, MAX_TOKENS)
    prompts = prompt_ids(model_dir)
    engine.add_request("first", prompts[0], SamplingParams(temperature=0, max_tokens=4))
    scheduled = engine.scheduler.schedule()
    plan = build_step_plan(scheduled, BLOCK_SIZE)
    tokens = runner.execute(plan).argmax(-1).tolist()  # type: ignore[union-attr]
    engine.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
    engine.add_request("second", prompts[1], SamplingParams(temperature=0, max_tokens=4))
    scheduled = engine.scheduler.schedule()
    plan = build_step_plan(scheduled, BLOCK_SIZE)
    assert plan.cu_seqlens_q[1] == 1 and not plan.is_decode_only  # "first" decodes beside "second"'s prompt
    want = runner.execute(plan)
    unknown = dataclasses.replace(
        plan, input_ids=[UNKNOWN_TOKEN, *plan.input_ids[1:]], unknown_rows=[0], unknown_sources=[1]
    )
    previous = torch.tensor([7, plan.input_ids[0]])  # the token sits in row 1 of what the previous step sampled
    torch.testing.assert_close(padded_logits(engine, graphs, unknown, previous), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="none were given"):
        graphs.prepare(unknown)


def test_steps_the_graphs_do_not_hold_are_refused(tiny_model):
    engine = LLMEngine.from_config(
        EngineConfig(model_path=tiny_model("llama"), device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE)
    )
    runner = engine.runner
    graphs = PrefillGraphs(runner.model, runner.kv_caches, runner.device, 2, 8, 32)

    def plan(lens: list[int], blocks: int = 1) -> StepPlan:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return StepPlan(
            seq_ids=list(range(len(lens))), input_ids=[1] * cu[-1], positions=list(range(cu[-1])),
            slot_mapping=[-1] * cu[-1], cu_seqlens_q=cu, seq_lens=lens, block_tables=[[0] * blocks] * len(lens),
            sample_indices=[c - 1 for c in cu[1:]], sample_seq_ids=list(range(len(lens))),
        )  # fmt: skip

    assert graphs.can_run(plan([20, 1]))
    assert not graphs.can_run(plan([1, 1]))  # decode-only: the decode graphs' work
    assert not graphs.can_run(plan([33]))  # more tokens than the largest bucket
    assert not graphs.can_run(plan([5, 1, 1]))  # more sequences than the graphs' batch
    assert not graphs.can_run(plan([5], blocks=9))  # a longer block table than captured
    with pytest.raises(ValueError, match="does not fit these graphs"):
        graphs.prepare(plan([33]))
