"""A structured request whose grammar's token masks are slow (an ambiguous grammar, ~1 s a mask at a 152k vocabulary:
benchmarks/results/grammar-compile-ebnf.md) must not hold the other requests' steps: the engine ends it at its first
mask past the limit, with an error that names the cause, and the rest of the batch runs on (tiny random Llama, CPU).

The slowness is a stand-in: the marked matchers' fills burn a fixed CPU time outside the GIL, as xgrammar's do
(through its single and batched fills alike; the limit is on a fill's CPU time), so the tests do not depend on this
machine's speed."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator

import openai
import pytest
import xgrammar

from tidal.worker.engine.async_engine import AsyncEngine, RequestInterruptedError
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

SLOW_FILL_S = 1.0  # each mask of a marked matcher, in CPU time
_BLOCK = bytes(1 << 18)


def burn_cpu(seconds: float) -> None:
    """Spends `seconds` of this thread's CPU time outside the GIL (hashlib lets it go for large inputs)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(_BLOCK).digest()


LIMIT_S = 0.05  # the engine's default per-token limit
# A step of the tiny model on a CPU takes milliseconds; the steps around a slow row's may be held about the limit.
MAX_STEP_S = 0.5

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def slow_matchers(monkeypatch) -> list[object]:
    """Matchers put in this list fill their masks SLOW_FILL_S late, alone or in a batch."""
    slow: list[object] = []
    single = xgrammar.GrammarMatcher.fill_next_token_bitmask
    batch = xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def fill(self, *args, **kwargs):
        if any(self is m for m in slow):
            burn_cpu(SLOW_FILL_S)
        return single(self, *args, **kwargs)

    def batch_fill(self, matchers, *args, **kwargs):
        if any(m is s for m in matchers for s in slow):
            burn_cpu(SLOW_FILL_S)
        return batch(self, matchers, *args, **kwargs)

    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask", fill)
    monkeypatch.setattr(xgrammar.BatchGrammarMatcher, "batch_fill_next_token_bitmask", batch_fill)
    return slow


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=256, **overrides)


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def engine(request, tiny_model) -> Iterator[LLMEngine]:
    engine = LLMEngine.from_config(engine_config(tiny_model("llama"), async_scheduling=request.param))
    yield engine
    engine.close()


def test_a_slow_mask_ends_its_request_and_does_not_hold_the_others(engine, slow_matchers):
    prompt = list(engine.tokenizer.encode("write some json"))
    json_params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(SCHEMA))
    engine.add_request("json", prompt, json_params)
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    slow_params = SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput(kind="regex", text="[a-z]+"))
    engine.add_request("slow", prompt, slow_params)
    slow_matchers.append(engine._samples["slow"][0].matcher)

    outputs: dict[str, list] = {"json": [], "plain": [], "slow": []}
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        step_outputs = engine.step()
        step_times.append(time.perf_counter() - start)
        for out in step_outputs:
            outputs[out.request_id].append(out)

    assert max(step_times) < MAX_STEP_S, f"a step was held {max(step_times):.2f} s by another request's mask"
    final = outputs["slow"][-1]
    assert final.finish_reason == "abort"
    assert final.error is not None
    assert "token mask took" in final.error and "limit 50 ms" in final.error and "simplify" in final.error
    assert outputs["plain"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs["plain"]) == 40
    assert outputs["json"][-1].finish_reason in ("stop", "length")
    if outputs["json"][-1].finish_reason == "stop":
        assert json.loads("".join(o.new_text for o in outputs["json"]))["ok"] in (True, False)
    assert engine.stats().num_grammar_mask_timeouts == 1


def test_the_client_of_a_slow_grammar_is_told_why(tiny_model, slow_matchers):
    """Through the async engine (what the server streams from): the request's stream raises an error carrying the
    cause, which the server sends as an error body (an SSE error event once streaming has started)."""
    engine = AsyncEngine.from_config(engine_config(tiny_model("llama")))
    params = SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput(kind="regex", text="[a-z]+"))
    llm = engine._engine
    original_add = llm.add_request

    def add_request(request_id, *args, **kwargs):  # the engine's loop makes the matchers: mark them as made
        original_add(request_id, *args, **kwargs)
        slow_matchers.extend(s.matcher for s in llm._samples[request_id])

    llm.add_request = add_request

    async def main():
        await engine.start()
        try:
            with pytest.raises(RequestInterruptedError, match=r"token mask took \d+ ms \(limit 50 ms\)"):
                async for _ in engine.generate("slow", [1, 2, 3], params):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_server_answers_a_slow_grammar_with_a_400(tmp_path, monkeypatch):
    """Through the real server and the official client: the request's own grammar ended it, so it is a 4xx naming
    the field (sent again, it would end again), not the 503 a sleep's interruption is."""
    single = xgrammar.GrammarMatcher.fill_next_token_bitmask

    def every_fill_slow(self, *args, **kwargs):
        burn_cpu(SLOW_FILL_S)
        return single(self, *args, **kwargs)

    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask", every_fill_slow)
    model_dir = write_tiny_model("llama", tmp_path / "tiny-llama")
    with serving_worker(model_dir, "tiny-llama") as servers:
        client = openai.OpenAI(base_url=f"{servers.url()}/v1", api_key="not-checked", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny-llama", prompt="hi", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "[a-z]+"}})  # fmt: skip
    error = caught.value.body
    assert error["code"] == "grammar_too_slow" and error["param"] == "structured_outputs", error
    assert "token mask took" in error["message"] and "simplify" in error["message"]
