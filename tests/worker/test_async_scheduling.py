"""Async scheduling gives the outputs of the step-at-a-time engine: the same delta stream for every request (tokens,
text, finish reasons, usage counts) on workloads with token and stop-string stops, length limits, preemption,
chunked prefill, prefix caching and requests arriving mid-run.

Requests arrive before a given call of step() in both modes, and call k launches the k-th step in both, so the two
engines schedule the same batches until a sequence ends on a token (the async engine learns that one step late and
has already launched a wasted row for it). Where no sequence can end on a token the schedules must be identical, and
unseeded sampling, which draws from one generator shared by the batch, then gives identical tokens too: that checks
that the async engine really schedules what the synchronous one would (length stops leave the batch in time).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.testing.hf_reference import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@dataclass
class Workload:
    config: dict
    # (call of step() before which the request is added, prompt, params)
    arrivals: list[tuple[int, list[int], SamplingParams]]
    eos_token_ids: set[int] | None = None
    same_schedule: bool = False  # no sequence can end on a token: the batches must be the same in both modes
    expect: set[str] = field(default_factory=set)  # what the workload must really exercise


@dataclass
class Run:
    streams: dict[str, list[tuple]]  # request id -> every RequestOutput of it, as tuples
    stats: dict
    num_calls_in_flight: int  # calls after which a step was left in flight


def run(model_dir, workload: Workload, async_scheduling: bool) -> Run:
    config = EngineConfig(
        model_path=model_dir, device="cpu", dtype="float32", async_scheduling=async_scheduling, **workload.config
    )
    engine = LLMEngine.from_config(config)
    if workload.eos_token_ids is not None:
        engine.eos_token_ids = workload.eos_token_ids
    arrivals = sorted(enumerate(workload.arrivals), key=lambda a: a[1][0])
    streams: dict[str, list[tuple]] = defaultdict(list)
    calls = in_flight = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][1][0] <= calls:
            i, (_, prompt, params) = arrivals.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            streams[out.request_id].append(tuple(out))
        calls += 1
        in_flight += engine.has_step_in_flight
        assert calls < 5000, "no progress"
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert_sampler_forgot_everything(engine)
    return Run(dict(streams), stats.model_dump(), in_flight)


def assert_sampler_forgot_everything(engine: LLMEngine) -> None:
    """No per-sequence sampler state outlives its sequence (a row sampled after its sequence ended must not make
    some again: token histories, logit edits, seeded generators)."""
    sampler = engine.sampler
    history = sampler._penalties._history
    assert history is None or history.num_tracked == 0
    assert not sampler._edits._bias and not sampler._edits._bans
    assert not sampler._per_request
    assert engine._num_structured == engine._num_controlled == engine._num_logprobs == 0


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama3")


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir)


@pytest.fixture(scope="module")
def probe(model_dir, prompts):
    """Each prompt's greedy continuation and text, to pick stop tokens and strings that really occur."""
    engine = LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=256, async_scheduling=False)
    )
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.close()
    return [(r.output_token_ids, r.text) for r in results]


SHORT_SCHEMAS = [
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]},
]


def structured_or_controlled(i: int) -> SamplingParams:
    if i % 3 == 0:  # structured, half of them with stateful controls and logprobs
        controls = {"presence_penalty": 0.5, "logit_bias": {5: 1.0}, "logprobs": 2} if i % 2 else {}
        spec = StructuredOutput.json_schema(SHORT_SCHEMAS[i % 2])
        return SamplingParams(temperature=0.9, seed=40 + i, max_tokens=40, structured=spec, **controls)
    if i % 3 == 1:
        return SamplingParams(temperature=0.8, seed=i, frequency_penalty=0.3, max_tokens=6 + i, ignore_eos=True)
    return GREEDY.model_copy(update={"max_tokens": 5 + i})


def staggered(prompts, params_for, calls=(0, 0, 0, 2, 3, 5, 5, 8, 13)):
    return [(calls[i % len(calls)], p, params_for(i)) for i, p in enumerate(prompts)]


def workloads(prompts, probe) -> dict[str, Workload]:
    def stop_id(i):  # the token request i generates greedily at step 3 + i % 5: it stops there or earlier
        return [probe[i][0][3 + i % 5]]

    def stop_str(i):
        text = probe[i][1]
        start = next((k for k in range(6, len(text) - 1) if "\ufffd" not in text[k : k + 2]), None)
        return [text[start : start + 2]] if start is not None else []

    eos = {probe[0][0][6], probe[5][0][2]}
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=18)
    repeated = prompts + prompts[1:5]  # the second copies hit the prefix cache (they arrive later)
    return {
        "greedy_token_stops": Workload(
            {"num_kv_blocks": 256, "block_size": 4},
            staggered(
                repeated,
                lambda i: GREEDY.model_copy(update={"stop_token_ids": stop_id(i % len(prompts))}),
                calls=(0, 0, 1, 1, 4, 6, 6, 9, 12, 15, 15, 20, 21),
            ),
            eos_token_ids=eos,
            expect={"stop", "length", "prefix_hits"},
        ),
        "seeded_sampling_with_stops": Workload(
            {"num_kv_blocks": 256},
            staggered(
                prompts,
                lambda i: seeded.model_copy(
                    update={"seed": 100 + i, "stop_token_ids": stop_id(i), "stop": stop_str(i) if i % 2 else []}
                ),
            ),
            eos_token_ids=eos,
            expect={"length"},
        ),
        "stop_strings": Workload(
            {"num_kv_blocks": 256},
            staggered(
                prompts,
                lambda i: GREEDY.model_copy(
                    update={"stop": stop_str(i), "include_stop_str_in_output": i % 2 == 0, "ignore_eos": True}
                ),
            ),
            expect={"stop"},
        ),
        "length_limits_unseeded": Workload(
            {"num_kv_blocks": 256, "max_model_len": 44},  # prompts of up to 42 tokens: some reach it
            staggered(prompts, lambda i: SamplingParams(temperature=1.0, max_tokens=3 + 3 * i, ignore_eos=True)),
            same_schedule=True,
            expect={"length"},
        ),
        "preemption": Workload(
            {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},
            staggered(
                prompts,
                lambda i: (
                    GREEDY.model_copy(update={"stop_token_ids": stop_id(i)})
                    if i % 2
                    else seeded.model_copy(update={"seed": i, "max_tokens": 16})
                ),
            ),
            eos_token_ids=eos,
            expect={"preemption"},
        ),
        "preemption_unseeded": Workload(
            {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 96},
            staggered(prompts, lambda i: SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True)),
            same_schedule=True,
            expect={"preemption"},
        ),
        "chunked_prefill_and_prefix_cache": Workload(
            {"num_kv_blocks": 128, "block_size": 8, "max_num_batched_tokens": 7, "max_num_seqs": 3},
            staggered(repeated, lambda i: GREEDY.model_copy(update={"stop_token_ids": stop_id(i % len(prompts))})),
            eos_token_ids=eos,
            expect={"prefix_hits"},
        ),
        # Later prompts continue earlier requests' greedy outputs: their prefix hits reach into generated tokens,
        # whose blocks are hashed only once those tokens are known.
        "continuations_hit_generated_blocks": Workload(
            {"num_kv_blocks": 256, "block_size": 4},
            [(0, p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts[:5]]
            + [(30, p + probe[i][0][:21] + [7], GREEDY) for i, p in enumerate(prompts[:5])],
            same_schedule=True,
            expect={"prefix_hits"},
        ),
        # Structured rows (their sampling waits for the read of the step before) among plain, seeded and penalised
        # ones; the structured ones end on their grammar, some with penalties, a seed and logprobs of their own.
        "structured_among_controls": Workload(
            {"num_kv_blocks": 256},
            staggered(prompts, structured_or_controlled),
            eos_token_ids=eos,
            expect={"stop", "length"},
        ),
        "chunked_prefill_unseeded": Workload(
            {"num_kv_blocks": 128, "block_size": 8, "max_num_batched_tokens": 7, "max_num_seqs": 3},
            staggered(repeated, lambda i: SamplingParams(temperature=1.0, max_tokens=4 + i % 7, ignore_eos=True)),
            same_schedule=True,
            expect={"prefix_hits"},
        ),
    }


NAMES = [
    "greedy_token_stops",
    "seeded_sampling_with_stops",
    "stop_strings",
    "length_limits_unseeded",
    "preemption",
    "preemption_unseeded",
    "chunked_prefill_and_prefix_cache",
    "chunked_prefill_unseeded",
    "continuations_hit_generated_blocks",
    "structured_among_controls",
]


@pytest.mark.parametrize("name", NAMES)
def test_async_scheduling_gives_the_synchronous_outputs(name, model_dir, prompts, probe):
    workload = workloads(prompts, probe)[name]
    sync = run(model_dir, workload, async_scheduling=False)
    overlapped = run(model_dir, workload, async_scheduling=True)
    assert sync.num_calls_in_flight == 0
    assert overlapped.num_calls_in_flight > len(sync.streams)  # it really ran ahead, step after step
    assert overlapped.streams.keys() == sync.streams.keys() == {f"r{i}" for i in range(len(workload.arrivals))}
    for request_id, want in sync.streams.items():
        assert overlapped.streams[request_id] == want, request_id
    for key in ("num_prompt_tokens", "num_generated_tokens", "num_kv_blocks"):
        assert overlapped.stats[key] == sync.stats[key], key
    if workload.same_schedule:
        assert overlapped.stats == sync.stats
    reasons = {stream[-1][3] for stream in sync.streams.values()}
    for what in workload.expect:
        if what == "preemption":
            assert sync.stats["num_preemptions"] > 0 and overlapped.stats["num_preemptions"] > 0
        elif what == "prefix_hits":
            assert sync.stats["num_prefix_cache_hit_tokens"] > 0
            assert overlapped.stats["num_prefix_cache_hit_tokens"] > 0
        else:
            assert what in reasons, (what, reasons)


def test_generate_gives_the_synchronous_results_and_leaves_nothing_in_flight(model_dir, prompts, probe):
    params = [GREEDY.model_copy(update={"stop_token_ids": [probe[i][0][2 + i % 4]]}) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.7, seed=5, max_tokens=9)

    def results(async_scheduling: bool):
        engine = LLMEngine.from_config(
            EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=256, async_scheduling=async_scheduling)
        )
        out = engine.generate(prompts, params)
        assert not engine.has_unfinished_requests() and not engine.has_step_in_flight
        return [(r.output_token_ids, r.text, r.finish_reason) for r in out]

    want = results(False)
    assert {reason for _, _, reason in want} == {"stop", "length"}
    assert results(True) == want


def test_a_logprobs_request_ending_before_its_last_row_is_sampled_leaves_the_next_read_whole(model_dir, prompts, probe):
    """With a structured request live, a step's sampling waits for the read of the step before. A logprobs request
    ending in that read (the only one asking) still has a row in the step; the rows the read of that step expects
    must be the ones sampled with logprobs, even once another logprobs request has arrived meanwhile."""
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=256))
    long_json = StructuredOutput.json_schema({"type": "array", "items": {"type": "boolean"}, "minItems": 40})
    engine.add_request("structured", prompts[0], SamplingParams(temperature=0.0, max_tokens=60, structured=long_json))
    stop = probe[1][0][3]
    engine.add_request("ends", prompts[1], GREEDY.model_copy(update={"logprobs": 1, "stop_token_ids": [stop]}))
    outputs: dict[str, list] = defaultdict(list)
    for _ in range(200):
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.request_id == "ends" and out.finish_reason is not None:
                engine.add_request("arrives", prompts[2], GREEDY.model_copy(update={"logprobs": 1, "max_tokens": 4}))
        if not engine.has_unfinished_requests():
            break
    assert outputs["ends"][-1].finish_reason == "stop"
    assert [len(o.logprobs or []) for o in outputs["arrives"]] == [1, 1, 1, 1]
    assert_sampler_forgot_everything(engine)
