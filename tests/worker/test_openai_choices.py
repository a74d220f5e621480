"""Several choices per request through the official `openai` client (sync and async, streamed and not), on the real
server and engine (tiny random Llama, CPU): `n` samples of a prompt, batched prompts, and /tokenize + /detokenize.

Greedy samples are all equal to one greedy run; seeded samples are reproducible (sample i draws with seed + i), so a
streamed answer can be compared with the whole one.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import openai
import pytest

from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hello there"}]
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory):
    model_dir = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    with serving_worker(model_dir, MODEL) as worker:
        yield worker.url()


def by_index(chunks, text_of) -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += text_of(choice) or ""
    return dict(texts)


def test_greedy_n_gives_n_copies_of_the_single_answer_and_counts_the_prompt_once(client):
    kwargs = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 6, "temperature": 0, "extra_body": EXTRA}
    single = client.completions.create(**kwargs)
    result = client.completions.create(**kwargs, n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [single.choices[0].text] * 3
    assert [c.finish_reason for c in result.choices] == ["length"] * 3
    assert result.usage.prompt_tokens == single.usage.prompt_tokens
    assert result.usage.completion_tokens == 18


def test_seeded_samples_differ_and_stream_as_they_are_whole(client):
    kwargs = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 10, "temperature": 1.0, "seed": 3}
    whole = client.completions.create(**kwargs, n=2, extra_body=EXTRA)
    texts = [c.text for c in whole.choices]
    assert texts[0] != texts[1]
    alone = client.completions.create(**{**kwargs, "seed": 4}, extra_body=EXTRA)
    assert alone.choices[0].text == texts[1]  # sample 1 draws with seed + 1
    chunks = list(
        client.completions.create(**kwargs, n=2, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA)
    )
    assert by_index(chunks, lambda c: c.text) == {0: texts[0], 1: texts[1]}
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_n_streamed_and_not(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0.8, "seed": 9}
    whole = client.chat.completions.create(**kwargs, n=2, extra_body=EXTRA)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(**kwargs, n=2, stream=True, extra_body=EXTRA))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks if c.choices[0].delta.role]
    assert roles == [(0, "assistant"), (1, "assistant")]
    assert by_index(chunks, lambda c: c.delta.content) == {i: c.message.content for i, c in enumerate(whole.choices)}


def test_batched_prompts_equal_separate_requests(client):
    prompts = ["one two three", "the tide comes in", "x"]
    kwargs = {"model": MODEL, "max_tokens": 5, "temperature": 0, "extra_body": EXTRA}
    separate = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    batched = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in batched.choices] == list(range(6))
    assert [c.text for c in batched.choices] == [s.choices[0].text for s in separate for _ in range(2)]
    assert batched.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in separate)
    assert batched.usage.completion_tokens == 30
    streamed = list(client.completions.create(prompt=prompts, n=2, stream=True, **kwargs))
    assert by_index(streamed, lambda c: c.text) == {c.index: c.text for c in batched.choices}


def test_batched_token_id_prompts(client):
    ids = [[5, 6, 7, 8], [9, 10]]
    kwargs = {"model": MODEL, "max_tokens": 4, "temperature": 0, "extra_body": EXTRA}
    batched = client.completions.create(prompt=ids, **kwargs)
    assert [c.text for c in batched.choices] == [
        client.completions.create(prompt=p, **kwargs).choices[0].text for p in ids
    ]
    assert batched.usage.prompt_tokens == 6


def test_a_bad_prompt_in_a_batch_refuses_the_request(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len is 256"):
        client.completions.create(model=MODEL, prompt=[[1, 2], [7] * 300], max_tokens=2)
    # The refused batch left nothing behind: the next request runs.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def test_async_client_n_and_batches(async_client, client):
    async def main():
        whole, chunks = await asyncio.gather(
            async_client.completions.create(
                model=MODEL, prompt=["a b c", "d e"], n=2, max_tokens=4, temperature=0, extra_body=EXTRA
            ),
            async_client.chat.completions.create(
                model=MODEL, messages=MESSAGES, n=3, max_tokens=4, temperature=0, stream=True, extra_body=EXTRA
            ),
        )
        return whole, [chunk async for chunk in chunks]

    whole, chunks = asyncio.run(main())
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text and whole.choices[2].text == whole.choices[3].text
    single = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body=EXTRA
    )
    assert by_index(chunks, lambda c: c.delta.content) == {i: single.choices[0].message.content for i in range(3)}


def test_tokenize_and_detokenize_round_trip(worker_url, client):
    text = "the tide comes in twice a day"
    tokenized = httpx.post(f"{worker_url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 256
    plain = httpx.post(f"{worker_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert len(plain["tokens"]) <= len(tokenized["tokens"])
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == tokenized["count"]  # the same tokenization as a completion's
    detokenized = httpx.post(f"{worker_url}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert detokenized == {"prompt": text}
    chat = httpx.post(f"{worker_url}/tokenize", json={"messages": MESSAGES}).json()
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "text"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "not served here"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "not served here"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "outside the tokenizer's vocabulary"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "exactly one of prompt and messages"),
    ],
)
def test_tokenize_refusals(worker_url, path, body, status, text):
    response = httpx.post(f"{worker_url}{path}", json=body)
    assert response.status_code == status, response.text
    assert text in response.json()["error"]["message"]


def cancelled(worker_url) -> float:
    for line in httpx.get(f"{worker_url}/metrics").text.splitlines():
        if line.startswith('tidal_requests_total{endpoint="completions",outcome="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_leaves_frees_every_choice(worker_url):
    before = cancelled(worker_url)
    body = {"model": MODEL, "prompt": ["a b", "c d e"], "n": 4, "max_tokens": 200, "stream": True, **EXTRA}
    with httpx.stream("POST", f"{worker_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # Gone after one chunk: both prompts' generations are cancelled, all 8 sequences aborted and their blocks freed.
    deadline = time.monotonic() + 20
    while True:
        metrics = httpx.get(f"{worker_url}/metrics").text
        if "tidal_requests_running 0.0" in metrics and "tidal_kv_cache_usage_ratio 0.0" in metrics:
            break
        assert time.monotonic() < deadline, "the choices were not freed"
        time.sleep(0.05)
    assert cancelled(worker_url) == before + 2
