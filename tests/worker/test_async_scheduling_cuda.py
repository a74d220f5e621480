"""Async scheduling on a CUDA device: the same delta streams as one step at a time (CUDA graphs, prompt-step graphs
and eager), a launch path that never waits for the device, the device still running the next step when the host gets
a step's outputs, and an idle device after abort_all and drain. Skipped without CUDA."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LONG = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make(model_dir, async_scheduling: bool = True, **overrides) -> LLMEngine:
    config = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 256, **overrides}
    return LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cuda", async_scheduling=async_scheduling, **config)
    )


def mixed_params(probe: list[list[int]]) -> list[SamplingParams]:
    """Greedy with a stop token that occurs, seeded top-k/top-p sampling, unseeded sampling with length stops."""
    out = []
    for i, tokens in enumerate(probe):
        if i % 3 == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[2 + i % 5]]))
        elif i % 3 == 1:
            out.append(SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=i, max_tokens=16))
        else:
            out.append(SamplingParams(temperature=1.0, max_tokens=4 + i, ignore_eos=True))
    return out


def controlled_params(probe: list[list[int]]) -> list[SamplingParams]:
    """mixed_params with the device-side controls on most rows: penalties (token histories appended on the device),
    logit_bias, min_tokens' bans and min-p."""
    controls = [
        {"presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.3, "min_p": 0.05},
        {"logit_bias": {7: 2.0, 11: -5.0}, "min_tokens": 3},
        {},
    ]
    return [p.model_copy(update=controls[i % len(controls)]) for i, p in enumerate(mixed_params(probe))]


def streams(engine: LLMEngine, prompts, params, calls=(0, 0, 0, 2, 3, 5, 5, 8, 13)) -> dict[str, list[tuple]]:
    arrivals = sorted((calls[i % len(calls)], i) for i in range(len(prompts)))
    out: dict[str, list[tuple]] = defaultdict(list)
    call = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= call:
            _, i = arrivals.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i])
        for delta in engine.step():
            out[delta.request_id].append(tuple(delta))
        call += 1
    return dict(out)


@pytest.mark.parametrize("make_params", [mixed_params, controlled_params], ids=["plain", "controls"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"enforce_eager": True},
        {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},
        {"max_num_batched_tokens": 48, "cuda_graph_prefill_tokens": 48},
    ],
    ids=["graphs", "eager", "graphs-preempting", "prompt-graphs"],
)
def test_overlapped_steps_give_the_synchronous_outputs(tiny_model, overrides, make_params):
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)
    probe = [r.output_token_ids for r in make(model_dir, False).generate(prompts, LONG)]
    params = make_params(probe)
    sync_engine, overlapped_engine = make(model_dir, False, **overrides), make(model_dir, True, **overrides)
    if "enforce_eager" not in overrides:
        assert overlapped_engine.runner.decode_graphs is not None
    if "cuda_graph_prefill_tokens" in overrides:  # chunks beside decodes whose inputs are not read yet
        assert overlapped_engine.runner.prefill_graphs is not None
    want = streams(sync_engine, prompts, params)
    assert {s[-1][3] for s in want.values()} >= {"stop", "length"}
    assert streams(overlapped_engine, prompts, params) == want
    if "num_kv_blocks" in overrides:
        assert sync_engine.stats().num_preemptions > 0 and overlapped_engine.stats().num_preemptions > 0


@pytest.mark.parametrize("make_params", [mixed_params, controlled_params], ids=["plain", "controls"])
def test_the_launch_of_a_decode_step_never_waits_for_the_device(tiny_model, monkeypatch, make_params):
    """torch raises on any synchronizing call (a pageable copy, .tolist(), .item(), a synchronize) in the launch
    of a graphed decode step: schedule, plan, inputs, the gather of unknown tokens, sampling (penalties, edits and
    the token histories' appends included), the host copy."""
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)
    probe = [r.output_token_ids for r in make(model_dir, False).generate(prompts, LONG)]
    engine = make(model_dir)
    launch = engine._launch
    strict = []

    def strict_launch(previous):
        scheduler = engine.scheduler
        decode_only = not scheduler.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in scheduler.running
        )
        if not decode_only:  # prefill attention may read lengths on the host: not this test's business
            return launch(previous)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            strict.append(previous is not None)

    monkeypatch.setattr(engine, "_launch", strict_launch)
    results = engine.generate(prompts, make_params(probe))
    assert len(results) == len(prompts)
    assert sum(strict) > 10  # many decode launches ran strictly, with the previous step in flight


def test_graphed_prompt_steps_never_wait_for_the_device_either(tiny_model, monkeypatch):
    """With prompt-step CUDA graphs every launch runs under torch's sync debug mode, prompt chunks and mixed steps
    included: their inputs go through pinned memory into the graphs' static buffers, padding included."""
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)
    engine = make(model_dir, max_num_batched_tokens=48, cuda_graph_prefill_tokens=48)
    # Greedy: a sampled request's first draw (its generator's setup) is the decode test's concern, not this one's.
    engine.generate(prompts, LONG)  # first calls (the sampler's, the allocator's) outside the check
    launch, graphs = engine._launch, engine.runner.prefill_graphs
    assert graphs is not None
    replay = graphs.run
    strict = {"launches": 0, "prompt replays": 0}

    def strict_launch(previous):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            strict["launches"] += 1

    def counted_replay(*args, **kwargs):
        strict["prompt replays"] += torch.cuda.get_sync_debug_mode() == 2  # inside a strict launch
        return replay(*args, **kwargs)

    monkeypatch.setattr(engine, "_launch", strict_launch)
    monkeypatch.setattr(graphs, "run", counted_replay)
    results = engine.generate(prompts, LONG)
    assert len(results) == len(prompts)
    assert strict["prompt replays"] >= 2 and strict["launches"] > strict["prompt replays"]


def _device_sleep_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that keep the device busy for about `ms` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def slowed(engine: LLMEngine, device_ms: float, monkeypatch) -> None:
    """Every step keeps the device busy about `device_ms` longer."""
    cycles = _device_sleep_cycles(device_ms)
    execute = engine.runner.execute

    def slow_execute(plan, previous_tokens=None):
        logits = execute(plan, previous_tokens)
        torch.cuda._sleep(cycles)  # queued behind the forward, ahead of the sampling
        return logits

    monkeypatch.setattr(engine.runner, "execute", slow_execute)


def test_the_host_reads_one_step_while_the_device_runs_the_next(tiny_model, monkeypatch):
    """Structural, not timed: each step keeps the device busy for 200 ms, so when step() hands back a step's
    outputs the next step must still be running on the device (with one step at a time it never is)."""
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)[:4]
    stream = torch.cuda.current_stream()

    def busy_after_each_output(async_scheduling: bool) -> list[bool]:
        engine = make(model_dir, async_scheduling)
        engine.generate(prompts, LONG)  # warm: first-call compilation outside the check
        with monkeypatch.context() as patch:
            slowed(engine, device_ms=200, monkeypatch=patch)
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            busy = []
            while engine.has_unfinished_requests():
                if engine.step():
                    busy.append(not stream.query())
        return busy

    assert not any(busy_after_each_output(False))
    overlapped = busy_after_each_output(True)
    assert overlapped[:-1] and all(overlapped[:-1])  # every output but the last arrives with the next step running


def test_abort_all_and_drain_leave_the_device_idle(tiny_model, monkeypatch):
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)[:3]
    engine = make(model_dir)
    slowed(engine, device_ms=100, monkeypatch=monkeypatch)
    stream = torch.cuda.current_stream()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, LONG)
    engine.step()
    engine.step()
    assert engine.has_step_in_flight and not stream.query()  # the device still works on the step in flight
    outputs = engine.drain()
    assert [o.num_output_tokens for o in outputs] == [2, 2, 2] and stream.query()
    engine.step()
    engine.step()
    assert engine.has_step_in_flight and not stream.query()
    finals = engine.abort_all()
    assert {o.finish_reason for o in finals} == {"abort"} and stream.query()
    assert not engine.has_unfinished_requests()
