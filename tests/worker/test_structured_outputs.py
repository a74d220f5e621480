"""Structured outputs in the engine (tiny random Llama, CPU): even a random model's output parses and conforms when
the grammar's mask forces it, plain rows batched with structured ones are untouched, and bad grammars are refused."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.errors import InvalidGrammarError
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput

# Bounded schemas: a random model must still be able to finish within max_tokens.
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[a-z ]{0,6}$"}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["color", "tags"],
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}},
        "required": ["a", "b"],
    },
    {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"]}},
        "required": ["inner"],
    },
]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def engine(tiny_model) -> Iterator[LLMEngine]:
    config = EngineConfig(model_path=tiny_model("llama"), device="cpu", dtype="float32", num_kv_blocks=256)
    engine = LLMEngine.from_config(config)
    yield engine
    engine.close()  # its mask fill thread must not outlive the module


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return list(engine.tokenizer.encode("write some json"))


def structured(
    spec: StructuredOutput, seed: int | None = None, temperature: float = 1.0, max_tokens: int = MAX_TOKENS
) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured=spec)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, prompt, temperature):
    params = [
        structured(StructuredOutput.json_schema(s), seed=i, temperature=temperature) for i, s in enumerate(SCHEMAS)
    ]
    results = engine.generate([prompt] * len(SCHEMAS), params)
    for schema, result in zip(SCHEMAS, results, strict=True):
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), schema)
    assert engine._num_structured == 0  # every matcher freed: plain batches are back on the overlapped path


def test_strict_schema_forbids_extra_properties(engine, prompt):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    results = engine.generate(
        [prompt] * 4, [structured(StructuredOutput.json_schema(schema), seed=s) for s in range(4)]
    )
    for result in results:
        assert list(json.loads(result.text)) == ["a"]


def test_json_object(engine, prompt):
    spec = StructuredOutput(kind="json_object")
    results = engine.generate([prompt] * 3, [structured(spec, seed=s, max_tokens=40) for s in range(3)])
    for result in results:
        if result.finish_reason == "stop":  # an unbounded object may run out of tokens with a random model
            assert isinstance(json.loads(result.text), dict)
        else:
            assert result.text.startswith("{")


def test_regex_choice_and_grammar(engine, prompt):
    choices = ["yes", "no", 'maybe "so"\n']
    specs = [
        StructuredOutput(kind="regex", text=r"[a-c]{3}-\d{2}"),
        StructuredOutput.choice(choices),
        StructuredOutput(kind="grammar", text='root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'),
    ]
    for seed in range(3):
        regex, choice, grammar = (r.text for r in engine.generate([prompt] * 3, [structured(s, seed) for s in specs]))
        assert re.fullmatch(r"[a-c]{3}-\d{2}", regex)
        assert choice in choices
        assert re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", grammar), grammar


def test_n_samples_each_conform(engine, prompt):
    engine.add_request("n", prompt, structured(StructuredOutput.choice(["alpha", "beta", "gamma"]), seed=3), n=3)
    texts: dict[int, str] = {}
    done = 0
    while done < 3:
        for out in engine.step():
            texts[out.sample_index] = texts.get(out.sample_index, "") + out.new_text
            done += out.finish_reason is not None
    engine.drain()
    assert sorted(texts) == [0, 1, 2] and all(t in {"alpha", "beta", "gamma"} for t in texts.values())


def test_plain_rows_are_untouched_by_structured_batch_mates(engine, prompt):
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, top_k=20, presence_penalty=0.5, max_tokens=24, ignore_eos=True),
    ]
    prompts = [prompt, prompt[:2], list(engine.tokenizer.encode("another prompt"))]
    alone = [engine.generate([p], [q])[0].output_token_ids for p, q in zip(prompts, plain, strict=True)]
    mixed_params = plain + [structured(StructuredOutput.json_schema(s), seed=i) for i, s in enumerate(SCHEMAS)]
    mixed = engine.generate(prompts + [prompt] * len(SCHEMAS), mixed_params)
    assert [r.output_token_ids for r in mixed[: len(plain)]] == alone
    for schema, result in zip(SCHEMAS, mixed[len(plain) :], strict=True):
        jsonschema.validate(json.loads(result.text), schema)


def test_abort_frees_the_matcher(engine, prompt):
    engine.add_request("to-abort", prompt, structured(StructuredOutput(kind="json_object"), seed=1))
    engine.step()
    engine.abort_request("to-abort")
    engine.drain()
    assert engine._num_structured == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(kind="json_schema", text='{"type": 5}'), "invalid json schema"),
        (StructuredOutput(kind="regex", text="(ab"), "invalid regex"),
        (StructuredOutput(kind="grammar", text="root ::= "), "invalid grammar"),
        (StructuredOutput(kind="grammar", text='start ::= "a"'), "invalid grammar"),
        # They compile, but no token may come first and the empty output is not theirs either.
        (StructuredOutput(kind="grammar", text="root ::= root"), "invalid grammar: it matches no string"),
        (StructuredOutput(kind="grammar", text='root ::= root "a"'), "invalid grammar: it matches no string"),
        (StructuredOutput(kind="regex", text="[^\\x00-\\U0010FFFF]"), "invalid regex: it matches no string"),
    ],
)
def test_bad_grammars_are_refused_before_queuing(engine, prompt, spec, message):
    with pytest.raises(InvalidGrammarError, match=message):
        engine.add_request("bad", prompt, structured(spec))
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_dead_ends_later_aborts_the_sample_alone(engine, prompt):
    """A dead end after some tokens is not found before queuing (that needs the grammar's whole analysis): the mask
    allows no token there, so the sample ends with "abort" and without the token sampled from nothing; its batch
    mate runs on untouched."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([prompt], plain)[0].output_token_ids
    dead_end = structured(StructuredOutput(kind="grammar", text='root ::= "a" rest\nrest ::= rest'), seed=0)
    plain_result, result = engine.generate([prompt, prompt], [plain, dead_end])
    assert plain_result.output_token_ids == alone
    assert result.finish_reason == "abort"
    assert result.text == "a" and engine.tokenizer.decode(result.output_token_ids) == "a"
    assert engine._num_structured == 0 and not engine.has_unfinished_requests()


def test_bounds():
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(kind="regex", text="a" * (64 * 1024 + 1))
    with pytest.raises(ValueError, match="at most 256"):
        StructuredOutput.choice([str(i) for i in range(257)])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(kind="json_object"))
