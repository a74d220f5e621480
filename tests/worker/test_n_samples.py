"""n samples of one prompt in the engine (tiny model, CPU): one prefill, each sample equal to a single request with
the same randomness (seed + index), greedy samples equal to n=1, and every block back after an abort."""

from __future__ import annotations

import asyncio

import pytest

from tidal.worker.engine.async_engine import AsyncEngine
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids

SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama3")


@pytest.fixture(scope="module")
def prompts(model_dir):
    # Lengths that end inside a block of 4 and on its boundary: the fork copies a partial block or none.
    ids = prompt_ids(model_dir)
    return [ids[1][:7], ids[3][:8], ids[4]]


def make(model_dir, async_scheduling: bool, **overrides) -> LLMEngine:
    config = {"num_kv_blocks": 64, "block_size": 4, **overrides}
    return LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", async_scheduling=async_scheduling, **config)
    )


def count_computed_tokens(engine: LLMEngine) -> list[int]:
    computed: list[int] = []
    execute = engine.runner.execute

    def counting(plan, previous_tokens=None):
        computed.append(plan.num_tokens)
        return execute(plan, previous_tokens)

    engine.runner.execute = counting  # type: ignore[method-assign]
    return computed


@pytest.mark.parametrize(
    ("async_scheduling", "kv_cache_dtype"), [(True, "auto"), (False, "auto"), (True, "fp8")]
)  # fp8: the fork copies an FP8 cache's partial block byte for byte
def test_each_seeded_sample_equals_a_single_request_seeded_with_its_index(
    model_dir, prompts, async_scheduling, kv_cache_dtype
):
    engine = make(model_dir, async_scheduling, kv_cache_dtype=kv_cache_dtype)
    free_at_start = engine.block_manager.num_free_blocks
    computed = count_computed_tokens(engine)
    n = 3
    results = engine.generate(prompts, SEEDED, n=n)
    assert [(r.request_id, r.sample_index) for r in results][:n] == [(results[0].request_id, j) for j in range(n)]
    # One prefill per prompt, then one token per step for each sample.
    assert sum(computed) == sum(len(p) for p in prompts) + len(prompts) * n * (SEEDED.max_tokens - 1)
    assert engine.stats().num_prompt_tokens == sum(len(p) for p in prompts)
    assert engine.block_manager.num_free_blocks == free_at_start
    single = make(model_dir, async_scheduling, kv_cache_dtype=kv_cache_dtype)
    for i, prompt in enumerate(prompts):
        samples = results[i * n : (i + 1) * n]
        for j, sample in enumerate(samples):
            [alone] = single.generate([prompt], SEEDED.model_copy(update={"seed": SEEDED.seed + j}))
            assert sample.output_token_ids == alone.output_token_ids, (i, j)
            assert sample.text == alone.text
        assert len({tuple(s.output_token_ids) for s in samples}) > 1  # the samples differ


def test_unseeded_samples_have_the_right_count_and_length(model_dir, prompts):
    engine = make(model_dir, True)
    results = engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True), n=4)
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    assert all(len(r.output_token_ids) == 5 and r.finish_reason == "length" for r in results)


def test_greedy_samples_equal_a_single_greedy_run(model_dir, prompts):
    engine = make(model_dir, True)
    [alone] = engine.generate(prompts[:1], GREEDY)
    results = engine.generate(prompts[:1], GREEDY, n=3)
    assert [r.text for r in results] == [alone.text] * 3
    assert [r.output_token_ids for r in results] == [alone.output_token_ids] * 3


def test_a_fork_without_free_blocks_still_gives_every_sample(model_dir, prompts):
    # 2 of 3 blocks hold the 7-token prompt, one is left for one copy: the third sample prefills on its own later.
    engine = make(model_dir, True, num_kv_blocks=3, max_model_len=12)
    [alone] = engine.generate(prompts[:1], GREEDY.model_copy(update={"max_tokens": 4}))
    results = engine.generate(prompts[:1], GREEDY.model_copy(update={"max_tokens": 4}), n=3)
    assert [r.output_token_ids for r in results] == [alone.output_token_ids] * 3
    assert engine.block_manager.num_free_blocks == 3


@pytest.mark.parametrize("after_steps", [0, 1, 2, 4])
def test_aborting_frees_every_sample_and_block(model_dir, prompts, after_steps):
    engine = make(model_dir, True)
    free_at_start = engine.block_manager.num_free_blocks
    engine.add_request("r", prompts[0], SEEDED, n=4)
    outputs = [out for _ in range(after_steps) for out in engine.step()]
    finals = engine.abort_request("r")
    assert sorted(f.sample_index for f in finals) == [0, 1, 2, 3]
    assert all(f.finish_reason == "abort" for f in finals)
    assert all(out.finish_reason is None for out in outputs)
    engine.drain()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free_at_start
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert engine.abort_request("r") == []
    engine.add_request("r", prompts[0], SEEDED, n=2)  # the id is free again


def test_async_engine_streams_every_sample_and_closing_the_stream_frees_them(model_dir, prompts):
    config = EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    expected = LLMEngine.from_config(config).generate(prompts[:1], SEEDED, n=3)

    async def main():
        engine = AsyncEngine.from_config(config)
        await engine.start()
        try:
            outputs = [out async for out in engine.generate("whole", prompts[0], SEEDED, n=3)]
            stream = engine.generate("left", prompts[0], SEEDED, n=3)
            await anext(stream)
            await stream.aclose()  # the client went away: every sample goes, with its blocks
            deadline = asyncio.get_running_loop().time() + 10
            while engine.stats().num_running or engine.stats().kv_cache_usage:
                assert asyncio.get_running_loop().time() < deadline, "the samples were not freed"
                await asyncio.sleep(0.01)
        finally:
            await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    for result in expected:
        mine = [o for o in outputs if o.sample_index == result.sample_index]
        assert [t for o in mine for t in o.new_token_ids] == result.output_token_ids
        assert "".join(o.new_text for o in mine) == result.text
        assert [o.finish_reason for o in mine][-1] == "length"
    assert sum(o.finish_reason is not None for o in outputs) == 3


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_samples_hold_the_prompt_blocks_together_after_one_prefill(model_dir, prompts, async_scheduling):
    engine = make(model_dir, async_scheduling)
    engine.add_request("r", prompts[0], SEEDED, n=3)  # 7 tokens: one full block, one partial
    while engine.scheduler.num_running < 3:
        engine.step()
    seqs = engine.scheduler.running
    full = seqs[0].block_table[0]
    assert [s.block_table[0] for s in seqs] == [full] * 3
    assert engine.block_manager.blocks[full].ref_count == 3
    assert len({s.block_table[1] for s in seqs}) == 3  # the partial block: a copy each
    assert [s.sample_index for s in seqs] == [0, 1, 2]
