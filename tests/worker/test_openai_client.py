"""The official `openai` client against the real server and engine (tiny random Llama, CPU).

Greedy decoding makes the streamed and the whole answers comparable: both must carry the same text and usage.
"""

from __future__ import annotations

import openai
import pytest

from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    with serving_worker(model_dir, MODEL) as worker:
        yield openai.OpenAI(base_url=f"{worker.url()}/v1", api_key="not-checked", max_retries=0, timeout=60)


def test_list_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion(client):
    result = client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion"
    assert result.choices[0].finish_reason == "length"
    assert isinstance(result.choices[0].text, str) and result.choices[0].text
    assert result.usage.completion_tokens == 6
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6


def test_streamed_completion_matches_the_whole_one(client):
    kwargs = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []  # the usage chunk comes last, with no choices
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant"
    assert isinstance(message.content, str)
    assert result.choices[0].finish_reason in ("stop", "length")
    assert 1 <= result.usage.completion_tokens <= 5


def test_streamed_chat_matches_the_whole_one(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_ends_the_text_before_it(client):
    kwargs = {"model": MODEL, "prompt": "stop test", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: no usable stop string in {full!r}"
    result = client.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[: full.index(stop)]


def test_client_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        client.completions.create(model=MODEL, prompt="x", n=17)
    with pytest.raises(openai.BadRequestError, match="max_model_len is 256"):
        client.completions.create(model=MODEL, prompt=[7] * 300)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="other", messages=MESSAGES)
