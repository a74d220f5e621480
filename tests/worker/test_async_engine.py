"""AsyncEngine: concurrent streams, refusal before queuing, abort by closing the stream or by id, an id aborted and
submitted again, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tidal.worker.engine.async_engine import AsyncEngine, EngineNotRunningError
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.errors import DuplicateRequestError, PromptTooLongError
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama3")


def config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=128, max_model_len=256, **overrides)


async def collect(engine, request_id, prompt, params=GREEDY):
    outputs = [out async for out in engine.generate(request_id, prompt, params)]
    return outputs


async def wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_the_sync_engine(model_dir):
    prompts = prompt_ids(model_dir)
    results = LLMEngine.from_config(config(model_dir)).generate(prompts, GREEDY)
    expected = [r.output_token_ids for r in results]

    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        assert engine.model_name == model_dir.name and engine.max_model_len == 256
        assert engine.tokenizer.chat_template
        await engine.start()
        try:
            runs = await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))
        finally:
            await engine.shutdown()
        return runs

    runs = asyncio.run(main())
    for outputs, want, prompt, result in zip(runs, expected, prompts, results, strict=True):
        assert [t for o in outputs for t in o.new_token_ids] == want
        assert "".join(o.new_text for o in outputs) == result.text
        assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
        assert outputs[-1].finish_reason == result.finish_reason
        assert outputs[-1].num_output_tokens == len(want) and outputs[-1].num_prompt_tokens == len(prompt)


def test_refusals_come_before_queuing(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        with pytest.raises(EngineNotRunningError):
            await anext(engine.generate("early", [1, 2], GREEDY))
        await engine.start()
        try:
            with pytest.raises(PromptTooLongError, match="at most 255"):
                await anext(engine.generate("long", [5] * 256, GREEDY))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await anext(engine.generate("bad", [10**6], GREEDY))
            stream = engine.generate("dup", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            await anext(stream)
            with pytest.raises(DuplicateRequestError):
                await anext(engine.generate("dup", [5, 6], GREEDY))
            await stream.aclose()
            assert engine.stats().num_waiting == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_closing_a_stream_aborts_and_frees_its_blocks(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        try:
            stream = engine.generate("gone", list(range(40, 80)), SamplingParams(max_tokens=200, ignore_eos=True))
            first = await anext(stream)
            assert first.new_token_ids and first.finish_reason is None
            assert engine.stats().kv_cache_usage > 0 or engine.stats().num_running == 1
            await stream.aclose()  # what a server does when the client disconnects
            await wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_abort_by_id_ends_the_stream(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        try:
            stream = engine.generate("victim", [7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True))
            await anext(stream)
            engine.abort("victim")
            engine.abort("no-such-request")  # harmless
            rest = [out async for out in stream]
            assert rest[-1].finish_reason == "abort"
            await wait_until(lambda: engine.stats().kv_cache_usage == 0.0)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("abort_by_id", [False, True])
def test_an_id_aborted_and_submitted_again_in_one_turn_gets_its_own_stream(model_dir, abort_by_id):
    """The old request's stream is closed (after an abort by id, or as the abort) and its id submitted again
    before the loop's next turn: the old request ends first, its final output goes nowhere, and the new one runs."""
    prompt = [4, 5, 6]
    fresh = LLMEngine.from_config(config(model_dir)).generate([prompt], GREEDY)[0]

    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        try:
            old = engine.generate("again", [7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True))
            await anext(old)
            # The loop waits inside a step while the abort and the new request both reach its inbox.
            stepping, go = threading.Event(), threading.Event()
            step = engine._engine.step

            def gated_step():
                stepping.set()
                go.wait()
                return step()

            engine._engine.step = gated_step
            assert await asyncio.to_thread(stepping.wait, 10.0)
            if abort_by_id:
                engine.abort("again")
            await old.aclose()
            new = engine.generate("again", prompt, GREEDY)
            first = asyncio.create_task(anext(new))
            await wait_until(lambda: engine.stats().num_waiting == 1)
            go.set()
            outputs = [await asyncio.wait_for(first, 10.0)] + [out async for out in new]
            await wait_until(lambda: engine.stats().kv_cache_usage == 0.0)
        finally:
            go.set()
            await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert [t for out in outputs for t in out.new_token_ids] == fresh.output_token_ids
    assert [out.finish_reason for out in outputs] == [None] * (len(outputs) - 1) + [fresh.finish_reason]


def test_shutdown_ends_running_streams_with_abort(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        stream = engine.generate("long", [7, 8, 9], SamplingParams(max_tokens=None, ignore_eos=True))
        await anext(stream)
        await engine.shutdown()
        rest = [out async for out in stream]
        assert rest[-1].finish_reason == "abort"
        assert not engine.is_running

    asyncio.run(main())


def test_a_request_aborted_while_held_never_runs(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        try:
            assert await asyncio.to_thread(engine.hold, 10.0)
            stream = engine.generate("held", [7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True))
            waiting = asyncio.create_task(anext(stream))
            await wait_until(lambda: engine.stats().num_waiting == 1)
            waiting.cancel()  # the client leaves while the request waits for admission
            with pytest.raises(asyncio.CancelledError):
                await waiting
            engine.release()
            await collect(engine, "after", [4, 5], SamplingParams(temperature=0, max_tokens=2))
            # The loop admits its inbox in order: had "held" been admitted, it would have been counted by now.
            assert engine.stats().num_prompt_tokens == 2
            assert engine.stats().num_running == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_abort_by_id_ends_a_held_request(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        try:
            assert await asyncio.to_thread(engine.hold, 10.0)
            stream = engine.generate("held", [7, 8, 9], GREEDY)
            waiting = asyncio.create_task(anext(stream))
            await wait_until(lambda: engine.stats().num_waiting == 1)
            engine.abort("held")
            first = await asyncio.wait_for(waiting, 10.0)
            assert first.finish_reason == "abort" and first.new_token_ids == []
            assert engine.stats().num_waiting == 0
            engine.release()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_ends_requests_still_waiting_for_admission(model_dir):
    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        await engine.start()
        assert await asyncio.to_thread(engine.hold, 10.0)
        stream = engine.generate("held", [7, 8, 9], GREEDY)
        waiting = asyncio.create_task(anext(stream))
        await wait_until(lambda: engine.stats().num_waiting == 1)
        await engine.shutdown()
        with pytest.raises(EngineNotRunningError):
            await asyncio.wait_for(waiting, 10.0)

    asyncio.run(main())


def test_a_loop_that_dies_ends_its_streams_and_the_worker_is_no_longer_ready(model_dir):
    from tidal.worker.server.runtime import Phase, WorkerRuntime

    async def main():
        engine = AsyncEngine.from_config(config(model_dir))
        runtime = WorkerRuntime(lambda: engine)
        await runtime.load()
        assert runtime.is_ready
        stream = engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)

        def broken():
            raise RuntimeError("bookkeeping broke")

        engine._engine.stats = broken  # fails outside the step's own recovery: the loop thread ends
        with pytest.raises(EngineNotRunningError, match="bookkeeping broke"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        await wait_until(lambda: not engine.is_running)
        assert runtime.phase is Phase.READY and not runtime.is_ready  # /ready and /health say 503 now
        with pytest.raises(EngineNotRunningError):
            await anext(engine.generate("late", [5, 6], GREEDY))

    asyncio.run(main())
