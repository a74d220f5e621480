"""Async scheduling at the edges: aborts with a step in flight, a request id reused while its old row is in flight,
drain(), the wasted row of a request that ended on a token, and AsyncEngine's holds and between_steps, which must
find no step in flight."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pytest

from tidal.worker.engine.async_engine import AsyncEngine
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama3")


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir)


def make(model_dir, async_scheduling: bool = True, **overrides) -> LLMEngine:
    config = {"num_kv_blocks": 128, "block_size": 4, **overrides}
    return LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", async_scheduling=async_scheduling, **config)
    )


def abort_after(engine: LLMEngine, prompts, victim_tokens: int) -> dict[str, list[tuple]]:
    """r0..r3 run; once r1 has 3 tokens it is aborted and its id reused for a new request (r1 was in the step
    in flight with the async engine). -> every request's outputs (the reused id's under "r1-again")."""
    params = [GREEDY, GREEDY, SEEDED, GREEDY]
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i + 1], params[i])
    streams: dict[str, list[tuple]] = defaultdict(list)
    reused = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = "r1-again" if reused and out.request_id == "r1" else out.request_id
            streams[key].append(tuple(out))
        if not reused and len(streams["r1"]) == victim_tokens:
            [final] = engine.abort_request("r1")
            streams["r1"].append(tuple(final))
            engine.add_request("r1", prompts[6], SEEDED)
            reused = True
    assert engine.stats().kv_cache_usage == 0.0
    return dict(streams)


def test_an_abort_with_the_request_in_flight_drops_its_pending_token(model_dir, prompts):
    engine = make(model_dir)
    got = abort_after(engine, prompts, victim_tokens=3)
    want = abort_after(make(model_dir, async_scheduling=False), prompts, victim_tokens=3)
    victim = got["r1"]
    assert [len(out[1]) for out in victim] == [1, 1, 1, 0] and victim[-1][3] == "abort"
    assert victim[-1][5] == 3  # num_output_tokens: what the client got, not the token still being sampled
    assert got == want  # the others, and the new request under the reused id, are untouched


def test_abort_all_with_a_step_in_flight_leaves_nothing_behind(model_dir, prompts):
    engine = make(model_dir)
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.has_step_in_flight
    finals = engine.abort_all()
    assert sorted(out.request_id for out in finals) == ["r0", "r1", "r2"]
    assert {out.finish_reason for out in finals} == {"abort"}
    assert all(out.num_output_tokens == 3 for out in finals)  # 4 steps launched, 3 read
    assert not engine.has_unfinished_requests() and not engine.has_step_in_flight
    assert engine.stats().kv_cache_usage == 0.0 and engine.step() == []
    fresh = make(model_dir).generate(prompts[:3], GREEDY)
    assert [r.output_token_ids for r in engine.generate(prompts[:3], GREEDY)] == [r.output_token_ids for r in fresh]


def test_drain_reads_the_step_in_flight_and_launches_nothing(model_dir, prompts):
    engine = make(model_dir)
    engine.add_request("r", prompts[1], GREEDY)
    assert engine.step() == [] and engine.has_step_in_flight  # launched, not read
    first = engine.drain()
    assert [(out.request_id, out.num_output_tokens) for out in first] == [("r", 1)]
    assert not engine.has_step_in_flight and engine.drain() == []
    tokens = list(first[0].new_token_ids)
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == make(model_dir, async_scheduling=False).generate([prompts[1]], GREEDY)[0].output_token_ids


def test_a_request_that_ends_on_a_token_leaves_a_wasted_row_in_flight(model_dir, prompts):
    full = make(model_dir).generate([prompts[2]], GREEDY)[0].output_token_ids
    engine = make(model_dir)
    engine.add_request("r", prompts[2], GREEDY.model_copy(update={"stop_token_ids": [full[4]]}))
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        outputs += engine.step()
    assert [t for out in outputs for t in out.new_token_ids] == full[: full.index(full[4]) + 1]
    assert outputs[-1].num_output_tokens == full.index(full[4]) + 1
    # The step launched after the stop token was sampled still holds the request's row: it must be read.
    assert engine.has_step_in_flight and engine.has_unfinished_requests()
    assert engine.step() == []
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0.0


def test_async_engine_holds_and_between_steps_find_no_step_in_flight(model_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [r.output_token_ids for r in make(model_dir, async_scheduling=False).generate(prompts, params)]
    seen_in_flight: list[bool] = []
    stop = threading.Event()

    def poke(engine: AsyncEngine) -> None:  # what KVFill does after a wake, many times over
        while not stop.is_set():
            with engine.between_steps() as llm:
                seen_in_flight.append(llm.has_step_in_flight)

    async def main():
        engine = AsyncEngine(make(model_dir))
        await engine.start()
        poker = threading.Thread(target=poke, args=(engine,))
        poker.start()
        try:
            runs = await asyncio.gather(*(_tokens(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
        finally:
            stop.set()
            await asyncio.to_thread(poker.join)
        # A hold that interrupts a running request: the loop aborts it and waits for the device.
        late = engine.generate("late", prompts[1], SamplingParams(max_tokens=None, ignore_eos=True))
        await anext(late)
        assert await asyncio.to_thread(engine.hold, 10.0, "going to sleep")
        with engine.quiesced() as llm:
            assert not llm.has_step_in_flight and not llm.has_unfinished_requests()
        engine.release()
        with pytest.raises(RuntimeError, match="going to sleep"):
            async for _ in late:
                pass
        await engine.shutdown()
        return runs

    assert asyncio.run(main()) == want
    assert seen_in_flight and not any(seen_in_flight)


async def _tokens(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for out in engine.generate(request_id, prompt, params) for t in out.new_token_ids]
