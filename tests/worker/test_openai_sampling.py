"""Sampling controls through the official `openai` client (sync and async, streamed and not) against the real server
and engine (tiny random Llama, CPU): penalties, logit_bias, top_k / min_p, min_tokens, stop_token_ids, many stop
strings, include_stop_str_in_output, seed, max_completion_tokens, stream usage and `user`."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "tell me a story"}]
SAMPLED = {
    "temperature": 0.9,
    "seed": 11,
    "presence_penalty": 0.6,
    "frequency_penalty": 0.4,
    "user": "someone",
}
EXTRA = {"ignore_eos": True, "repetition_penalty": 1.3, "top_k": 30, "min_p": 0.02, "min_tokens": 3}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    with serving_worker(model_dir, MODEL) as servers:
        yield servers, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker[0].url()}/v1", api_key="not-checked", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(worker):
    return worker[1]


def async_client(worker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{worker[0].url()}/v1", api_key="not-checked", max_retries=0, timeout=60)


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_seeded_sampling_with_controls_repeats_and_streams_the_same(client):
    kwargs = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 12, **SAMPLED}
    first = client.completions.create(**kwargs, extra_body=EXTRA)
    again = client.completions.create(**kwargs, extra_body=EXTRA)
    assert first.choices[0].text == again.choices[0].text and first.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA)
    )
    assert streamed_text(chunks) == first.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == first.usage.model_dump()
    plain = client.completions.create(**{**kwargs, "presence_penalty": 0, "frequency_penalty": 0}, extra_body=EXTRA)
    other_seed = client.completions.create(**{**kwargs, "seed": 12}, extra_body=EXTRA)
    assert first.choices[0].text not in (plain.choices[0].text, other_seed.choices[0].text)


def test_logit_bias_forces_a_token(client, tokenizer):
    token = tokenizer.encode("story", add_special_tokens=False)[0]
    result = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert result.choices[0].text == tokenizer.decode([token] * 5)


def test_min_tokens_and_stop_token_ids(client, tokenizer):
    kwargs = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop_id = tokenizer.encode(full, add_special_tokens=False)[0]
    stopped = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = client.completions.create(
        **kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 4}
    )
    assert held.usage.completion_tokens >= 4


def test_many_stop_strings_and_include_stop_str(client):
    kwargs = {"model": MODEL, "prompt": "stop test", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: no usable stop string in {full!r}"
    stops = [f"never {i}" for i in range(30)] + [stop]
    cut = client.completions.create(**kwargs, stop=stops, extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(stop)]
    kept = client.completions.create(
        **kwargs, stop=stops, stream=True, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert streamed_text(list(kept)) == full[: full.index(stop) + len(stop)]


def test_async_chat_with_controls_streamed_and_whole(worker):
    async def run():
        async with async_client(worker) as client:
            kwargs = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 10, **SAMPLED}
            whole = await client.chat.completions.create(**kwargs, extra_body=EXTRA)
            stream = await client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA
            )
            chunks = [c async for c in stream]
            return whole, chunks

    whole, chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_async_completion_with_logit_bias(worker, tokenizer):
    token = tokenizer.encode("fox", add_special_tokens=False)[0]

    async def run():
        async with async_client(worker) as client:
            return await client.completions.create(
                model=MODEL, prompt="x", max_tokens=3, temperature=0.5, seed=1, logit_bias={str(token): 100}
            )

    assert asyncio.run(run()).choices[0].text == tokenizer.decode([token] * 3)


def test_sampling_refusals_are_clear(client):
    with pytest.raises(openai.BadRequestError, match="logit_bias key '999999' is not a token id of this model"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"999999": 1})
    with pytest.raises(openai.BadRequestError, match=r"\(4301 digits\) is not a token id of this model"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"1" * 4301: 1})  # was a 500
    with pytest.raises(openai.BadRequestError, match="at most 64 stop sequences"):
        client.completions.create(model=MODEL, prompt="x", stop=[str(i) for i in range(65)])
    with pytest.raises(openai.BadRequestError, match="disagree"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, max_completion_tokens=4)
