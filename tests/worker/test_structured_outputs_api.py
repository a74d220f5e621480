"""Structured outputs through the official `openai` client against the real server (tiny random Llama, CPU):
`response_format` (json_object, json_schema; on completions too, as vLLM's) and the `structured_outputs` extension,
sync and async, streamed and not; a bad schema or grammar is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tidal.worker.testing.in_process import serving_worker
from tidal.worker.testing.tiny_models import write_tiny_model

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "a person as json"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "admin": {"type": "boolean"}},
    "required": ["name", "admin"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
# The report's schema: 42 KB, under the 64 KiB cap; 12 s of the compiler's two threads at a 49k vocabulary.
COSTLY = {"type": "object", "properties": {f"a{i}": {"type": "string"} for i in range(1500)}}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    with serving_worker(model_dir, MODEL) as servers:
        yield servers


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url()}/v1", api_key="not-checked", max_retries=0, timeout=60)


@pytest.mark.parametrize("seed", [0, 1])
def test_chat_json_schema(client, seed):
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=100, seed=seed, response_format=RESPONSE_FORMAT
    )
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)


def test_streamed_chat_json_schema_matches_the_whole_one(client):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "temperature": 0}
    whole = client.chat.completions.create(**kwargs, response_format=RESPONSE_FORMAT)
    chunks = list(client.chat.completions.create(**kwargs, response_format=RESPONSE_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object_with_n(client):
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, n=2, seed=4, response_format={"type": "json_object"}
    )
    for choice in result.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # an unconstrained object may run out of tokens with a random model
            assert choice.message.content.startswith("{")


def test_completions_regex_and_choice_extensions(client):
    regex = client.completions.create(
        model=MODEL, prompt="code:", max_tokens=20, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}\d{3}"}}
    )
    assert re.fullmatch(r"[A-Z]{2}\d{3}", regex.choices[0].text)
    choice = client.completions.create(
        model=MODEL, prompt="pick:", max_tokens=20, extra_body={"structured_outputs": {"choice": ["left", "right"]}}
    )
    assert choice.choices[0].text in {"left", "right"}
    as_json = client.completions.create(
        model=MODEL, prompt="{", max_tokens=100, seed=2, extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}}
    )
    jsonschema.validate(json.loads(as_json.choices[0].text), SCHEMA)


def test_completions_response_format_streamed_or_not(client):
    """vLLM's completions take chat's response_format too: the same structured-output path."""
    kwargs = {"model": MODEL, "prompt": "a person as json:", "max_tokens": 100, "temperature": 0,
              "extra_body": {"response_format": RESPONSE_FORMAT}}  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole.text
    as_object = client.completions.create(
        model=MODEL, prompt="{", max_tokens=120, n=2, seed=4, extra_body={"response_format": {"type": "json_object"}}
    )
    for choice in as_object.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # an unconstrained object may run out of tokens with a random model
            assert choice.text.startswith("{")
    plain = {"response_format": {"type": "text"}, "structured_outputs": {"choice": ["left", "right"]}}
    text = client.completions.create(model=MODEL, prompt="pick:", max_tokens=20, extra_body=plain).choices[0].text
    assert text in {"left", "right"}  # a text response_format leaves the extension's constraint alone


def test_async_client_streamed_and_not(worker):
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{worker.url()}/v1", api_key="x", max_retries=0, timeout=60)
        body = {"structured_outputs": {"grammar": 'root ::= "<" [a-z] [a-z]? ">"'}}
        whole = await client.completions.create(
            model=MODEL, prompt="tag", max_tokens=10, temperature=0, extra_body=body
        )
        stream = await client.completions.create(
            model=MODEL, prompt="tag", max_tokens=10, temperature=0, extra_body=body, stream=True
        )
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        await client.close()
        return whole.choices[0].text, streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed and re.fullmatch(r"<[a-z]{1,2}>", whole)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format", "invalid json schema"),
        # The field the request used is named, not response_format (which it did not send).
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", "invalid regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "nothing ::= "}}}, "structured_outputs", "invalid grammar"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= root"}}}, "structured_outputs",
         "invalid grammar: it matches no string"),
        ({"extra_body": {"structured_outputs": {"json": {"type": 5}}}}, "structured_outputs", "invalid json schema"),
        ({"response_format": {"type": "text"}, "extra_body": {"structured_outputs": {"regex": "(("}}},
         "structured_outputs", "invalid regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"choice": [str(i) for i in range(300)]}}}, "structured_outputs",
         "at most 256"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}}, None,
         "send one"),
        # Past the compile-cost bound (schema_cost.py): refused before compiling, naming the part at fault.
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": COSTLY}}},
         "response_format", "properties of #: 1500 optional properties, at most 200 are compiled"),
        ({"extra_body": {"structured_outputs": {"regex": "([a-z]{1,10}){1,100}"}}}, "structured_outputs",
         "makes 1000 nested copies, at most 16 are compiled"),
        # An EBNF grammar too (ebnf_cost.py): [a-z]{4000} took 0.7 s at 152k tokens; nested copies of a variable
        # body, also through a rule, make every token's mask slow.
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= [a-z]{4000}"}}}, "structured_outputs",
         "the grammar would take too long to compile: its estimated cost is 770 units"),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= (w " "?){1,100}\nw ::= [a-z]{1,10}'}}},
         "structured_outputs", "the rule root: the repetition (w \" \"?){1,100} of a repetition of variable length "
         "makes 1000 nested copies, at most 16 are allowed"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_400(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **body)
    error = caught.value.body
    assert message in error["message"]
    if param is not None:
        assert error["param"].startswith(param)


def test_a_schema_without_strict_compiles_strictly(client):
    """Unset strict is strict (as vLLM's): the same schema with strict false admits unlisted properties, which costs
    xgrammar a rule per prefix of the 30 names (3.5 s or more at a 49k vocabulary), and is refused."""
    names = [f"customer_field_{i:05d}" for i in range(30)]
    schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names}
    spec = {"name": "wide", "schema": schema}
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, response_format={"type": "json_schema", "json_schema": spec}
    )
    with pytest.raises(openai.BadRequestError, match="additionalProperties false avoids this"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3,
            response_format={"type": "json_schema", "json_schema": {**spec, "strict": False}},
        )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format", "invalid json schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
         "response_format", "pattern"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None, "send one"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"grammar": 'root ::= "<" w{1,4000} ">"\nw ::= [^"]'}}, "structured_outputs",
         "the costliest part is the rule root, at w{1,4000}"),
    ],
)  # fmt: skip
def test_bad_completions_response_format_is_400(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=body)
    error = caught.value.body
    assert message in error["message"]
    if param is not None:
        assert error["param"].startswith(param)
