"""Logprobs, echo, prompt logprobs (both endpoints) and token ids through the official `openai` client (sync and
async, streamed and not) on the real server and engine (tiny random Llama, CPU), against a log_softmax of
transformers' logits on the same weights in fp32; and lm-eval's log-likelihood request (`local-completions`: echo,
logprobs 1, max_tokens 0 or 1)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from tidal.worker.testing.hf_reference import load_reference_model
from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny-llama"
ATOL = 2e-4
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def worker_url(model_dir):
    with serving_worker(model_dir, MODEL) as worker:
        yield worker.url()


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_reference_model(model_dir)

    @torch.no_grad()
    def get(token_ids: list[int]) -> torch.Tensor:
        """[len, V]: row p scores token p + 1."""
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return get


def extra(choice_or_response, key):
    return (choice_or_response.model_extra or {})[key]


def test_completion_logprobs_equal_transformers_streamed_or_not(client, reference):
    kwargs = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 5, "temperature": 0, "logprobs": 3}
    whole = client.completions.create(**kwargs, extra_body=EXTRA)
    choice = whole.choices[0]
    prompt_ids, ids = extra(choice, "prompt_token_ids"), extra(choice, "token_ids")
    assert len(ids) == 5
    expected = reference(prompt_ids + ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for t, token in enumerate(ids):
        row = expected[len(prompt_ids) + t - 1]
        assert lp.token_logprobs[t] == pytest.approx(row[token].item(), abs=ATOL)
        assert max(lp.top_logprobs[t].values()) == pytest.approx(lp.token_logprobs[t], abs=ATOL)  # greedy
        # Keyed by text: tokens of the tiny tokenizer that decode alike share a key (the likelier one's value).
        top3 = row.topk(3).values.tolist()
        assert 1 <= len(lp.top_logprobs[t]) <= 3
        assert all(any(abs(v - w) < ATOL for w in top3) for v in lp.top_logprobs[t].values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=EXTRA))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [i for c in chunks for ch in c.choices for i in extra(ch, "token_ids")] == ids
    assert extra(chunks[0].choices[0], "prompt_token_ids") == prompt_ids


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_as_lm_eval_sends_it(client, reference, model_dir, max_tokens, stream):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_dir)("the cat sat on the mat")["input_ids"]
    # lm-eval's local-completions: token ids, echo, logprobs 1, temperature 0, max_tokens 0 or 1.
    kwargs = {"model": MODEL, "prompt": prompt_ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
              "temperature": 0, "stream": stream}  # fmt: skip
    if stream:
        chunks = list(client.completions.create(**kwargs, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        pieces = [ch for c in chunks for ch in c.choices]
        text = "".join(ch.text for ch in pieces)
        token_logprobs = [v for ch in pieces if ch.logprobs for v in ch.logprobs.token_logprobs]
        tops = [v for ch in pieces if ch.logprobs for v in ch.logprobs.top_logprobs]
        finish = pieces[-1].finish_reason
    else:
        whole = client.completions.create(**kwargs)
        usage, choice = whole.usage, whole.choices[0]
        text, token_logprobs, tops = choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
        finish = choice.finish_reason
    assert usage.prompt_tokens == len(prompt_ids) and usage.completion_tokens == max_tokens
    assert finish == "length"
    assert len(token_logprobs) == len(prompt_ids) + max_tokens
    assert token_logprobs[0] is None and tops[0] is None
    expected = reference(prompt_ids)
    for p in range(1, len(prompt_ids)):
        assert token_logprobs[p] == pytest.approx(expected[p - 1, prompt_ids[p]].item(), abs=ATOL)
        assert prompt_ids[p] is not None and len(tops[p]) in (1, 2)
    assert text.startswith("the cat sat on the mat") or "cat sat" in text


def test_prompt_logprobs_extension(client, reference):
    whole = client.completions.create(
        model=MODEL, prompt="hello world again", max_tokens=1, extra_body={"prompt_logprobs": 2, **EXTRA}
    )
    choice = whole.choices[0]
    prompt_ids = extra(choice, "prompt_token_ids")
    got = extra(choice, "prompt_logprobs")
    assert len(got) == len(prompt_ids) and got[0] is None
    expected = reference(prompt_ids)
    for p in range(1, len(prompt_ids)):
        entry = got[p][str(prompt_ids[p])]
        assert entry["logprob"] == pytest.approx(expected[p - 1, prompt_ids[p]].item(), abs=ATOL)
        assert {int(k) for k in got[p]} >= set(expected[p - 1].topk(2).indices.tolist())


@pytest.mark.parametrize("stream", [False, True])
def test_chat_prompt_logprobs_equal_the_completions_ones(client, reference, model_dir, stream):
    """The response's (streamed: each role chunk's) prompt_logprobs are the completions endpoint's for the chat
    prompt's token ids, and transformers' log_softmax."""
    from transformers import AutoTokenizer

    body = {"prompt_logprobs": 3, **EXTRA}
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 2,
              "temperature": 0, "extra_body": body}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, n=2, stream=True))
        firsts = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
        assert sorted(c.choices[0].index for c in firsts) == [0, 1]
        assert all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks if c not in firsts)
        prompt_ids, got = extra(firsts[0], "prompt_token_ids"), extra(firsts[0], "prompt_logprobs")
        assert extra(firsts[1], "prompt_logprobs") == got
    else:
        whole = client.chat.completions.create(**kwargs)
        prompt_ids, got = extra(whole, "prompt_token_ids"), extra(whole, "prompt_logprobs")
        assert "prompt_logprobs" not in (whole.choices[0].model_extra or {})
    completion = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=1, extra_body=body)
    assert extra(completion.choices[0], "prompt_token_ids") == prompt_ids
    want = extra(completion.choices[0], "prompt_logprobs")
    assert len(got) == len(want) == len(prompt_ids) and got[0] is None and want[0] is None
    texts = AutoTokenizer.from_pretrained(model_dir)
    expected = reference(prompt_ids)
    for p in range(1, len(prompt_ids)):
        assert got[p].keys() == want[p].keys()
        for key, entry in got[p].items():
            assert entry["logprob"] == pytest.approx(want[p][key]["logprob"], abs=1e-6)
            assert entry["rank"] == want[p][key]["rank"] and entry["decoded_token"] == texts.decode([int(key)])
        token = prompt_ids[p]
        assert got[p][str(token)]["logprob"] == pytest.approx(expected[p - 1, token].item(), abs=ATOL)
        assert {int(k) for k in got[p]} >= set(expected[p - 1].topk(3).indices.tolist())


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_async(worker_url, reference, stream):
    async def run():
        async_client = openai.AsyncOpenAI(base_url=f"{worker_url}/v1", api_key="x", max_retries=0, timeout=60)
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "temperature": 0, "logprobs": True, "top_logprobs": 2, "extra_body": EXTRA}  # fmt: skip
        if not stream:
            response = await async_client.chat.completions.create(**kwargs)
            choice = response.choices[0]
            return extra(response, "prompt_token_ids"), extra(choice, "token_ids"), choice.logprobs.content
        chunks = [c async for c in await async_client.chat.completions.create(**kwargs, stream=True)]
        content = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {}).get("token_ids") or []]
        return extra(chunks[0], "prompt_token_ids"), ids, content

    prompt_ids, ids, content = asyncio.run(run())
    assert len(ids) == len(content) == 4
    expected = reference(prompt_ids + ids)
    for t, entry in enumerate(content):
        row = expected[len(prompt_ids) + t - 1]
        assert entry.logprob == pytest.approx(row[ids[t]].item(), abs=ATOL)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=ATOL)
        assert entry.bytes == list(entry.token.encode())


def test_processed_logprobs_follow_temperature_and_penalties(client, reference):
    kwargs = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 5, "temperature": 0.6, "seed": 7,
              "logprobs": 2, "presence_penalty": 0.5}  # fmt: skip
    raw = client.completions.create(**kwargs, extra_body=EXTRA).choices[0]
    processed = client.completions.create(**kwargs, extra_body={**EXTRA, "logprobs_mode": "processed"}).choices[0]
    ids, prompt_ids = extra(raw, "token_ids"), extra(raw, "prompt_token_ids")
    assert extra(processed, "token_ids") == ids  # the same draws: logprobs do not change sampling
    expected = reference(prompt_ids + ids)
    for t, token in enumerate(ids):
        row = expected[len(prompt_ids) + t - 1]
        assert raw.logprobs.token_logprobs[t] == pytest.approx(row[token].item(), abs=ATOL)
        penalised = row.clone()
        penalised[list(set(ids[:t]))] -= 0.5
        scaled = (penalised / 0.6).log_softmax(-1)
        assert processed.logprobs.token_logprobs[t] == pytest.approx(scaled[token].item(), abs=ATOL)


def test_n_and_batched_prompts_with_logprobs(client):
    whole = client.completions.create(
        model=MODEL, prompt=["a b c", "x y"], n=2, max_tokens=3, temperature=0.8, seed=1, logprobs=1,
        extra_body=EXTRA,
    )  # fmt: skip
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    for choice in whole.choices:
        assert len(choice.logprobs.token_logprobs) == len(extra(choice, "token_ids")) == 3
        assert all(v <= 0 for v in choice.logprobs.token_logprobs)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None),
        ("/v1/completions", {"prompt": "x", "logprobs_mode": "final"}, "logprobs_mode"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21},
            "prompt_logprobs",
        ),
    ],
)
def test_out_of_range_requests_are_400(worker_url, path, body, param):
    response = httpx.post(f"{worker_url}{path}", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_plain_responses_carry_no_extension_fields(worker_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    choice = httpx.post(f"{worker_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["logprobs"] is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    chat = httpx.post(f"{worker_url}/v1/chat/completions", json=body, timeout=30).json()
    assert set(chat) == {"id", "object", "created", "model", "choices", "usage"}
