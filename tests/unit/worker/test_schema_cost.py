"""The admission bound on structured outputs' compile cost (engine/schema_cost.py, regex_cost.py): what it refuses,
where its message points, and that ordinary schemas pass. Pure: no xgrammar."""

from __future__ import annotations

import json
import random
import re

import pytest
from pydantic import ValidationError

from tidal.worker.engine.regex_cost import MAX_GROUP_DEPTH, regex_states
from tidal.worker.engine.schema_cost import (
    COST_BUDGET,
    MAX_DEPTH,
    MAX_OPTIONAL_PROPERTIES,
    CompileCostError,
    _num_prefixes,
    check_json_schema,
    check_regex,
    check_structural_tag,
    json_schema_cost,
)
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.server.tool_calls import qwen

STRING = {"type": "string"}
EMAIL = {"type": "string", "format": "email"}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": required or [], **extra}


def nested(depth: int) -> dict:
    schema: dict = STRING
    for level in range(depth):
        schema = obj({f"k{level}": schema}, [f"k{level}"])
    return schema


def check(schema: dict, strict: bool = True) -> None:
    check_json_schema(json.dumps(schema, sort_keys=True), strict)


# Schemas people send: they must all pass, with room to spare.
ORDINARY = [
    obj({"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 150}}, ["name", "age"]),
    obj(
        {
            "id": {"type": "string", "format": "uuid"},
            "created": {"type": "string", "format": "date-time"},
            "email": EMAIL,
            "tags": {"type": "array", "items": STRING, "maxItems": 10},
            "status": {"enum": ["open", "closed", "pending"]},
            "address": obj({k: STRING for k in ("street", "city", "zip", "country")}, ["city"]),
            "phone": {"type": "string", "pattern": r"^\+?[0-9]{7,15}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        },
        ["id", "email", "status"],
    ),
    {
        "$defs": {
            "node": obj(
                {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}
            )
        },
        "$ref": "#/$defs/node",
    },
    obj({f"field_{i}": {"type": ["string", "null"]} for i in range(60)}, [f"field_{i}" for i in range(60)]),
    obj({f"opt_{i}": {"type": "integer"} for i in range(100)}),
    nested(20),
]


@pytest.mark.parametrize("schema", ORDINARY)
def test_ordinary_schemas_pass_with_room_to_spare(schema):
    check(schema)
    assert json_schema_cost(schema, strict=True) < COST_BUDGET / 2


def test_the_reported_schema_is_refused_naming_its_optional_properties():
    schema = obj({f"a{i}": STRING for i in range(1500)})  # 42 KB: under the 64 KiB cap, 12 s to compile
    with pytest.raises(
        CompileCostError, match=f"properties of #: 1500 optional properties, at most {MAX_OPTIONAL_PROPERTIES}"
    ):
        check(schema)
    # Required ones are cheap (linear): the same properties, half of them required, still exceed the limit alone.
    check(obj({f"a{i}": STRING for i in range(MAX_OPTIONAL_PROPERTIES)}))


def test_the_message_points_into_the_schema():
    inner = obj({f"x{i}": STRING for i in range(MAX_OPTIONAL_PROPERTIES + 1)})
    schema = obj({"a/b": obj({"c": {"type": "array", "items": inner}})})
    with pytest.raises(CompileCostError, match=r"properties of #/properties/a~1b/properties/c/items: 201 optional"):
        check(schema)


def test_nesting_past_the_limit_is_refused():
    check(nested(MAX_DEPTH))
    with pytest.raises(CompileCostError, match=f"nested {MAX_DEPTH + 1} deep, at most {MAX_DEPTH}"):
        check(nested(MAX_DEPTH + 1))


def test_unlisted_properties_cost_a_rule_per_prefix_of_the_names():
    """30 names of 20 characters took 3.5-6.7 s to compile with strict false, 7 ms strictly."""
    names = [f"customer_field_{i:05d}" for i in range(30)]
    schema = obj(dict.fromkeys(names, STRING), names)
    check(schema, strict=True)
    check(obj(dict.fromkeys(names, STRING), names, additionalProperties=False), strict=False)
    with pytest.raises(CompileCostError, match=r"the property names of #, .*additionalProperties false avoids"):
        check(schema, strict=False)
    with pytest.raises(CompileCostError, match="the property names of #"):
        check(obj(dict.fromkeys(names, STRING), names, additionalProperties={"type": "integer"}))
    check({"type": "object", "additionalProperties": STRING}, strict=False)  # a map: no names to tell apart


def test_costly_formats_add_up_but_a_ref_is_compiled_once():
    emails = [f"e{i}" for i in range(50)]
    with pytest.raises(CompileCostError, match="the costliest part is the format email of #/properties/e"):
        check(obj(dict.fromkeys(emails, EMAIL), emails))
    check({"$defs": {"e": EMAIL}, **obj({name: {"$ref": "#/$defs/e"} for name in emails}, emails)})


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("^([a-z]{1,10}){1,100}$", "the repetition {1,100} of a repetition of variable length makes 1000 nested"),
        ("^([a-z]{1,8}){1,8}$", "makes 64 nested copies, at most 16"),
        ("^[a-z]{1,8000}$", "would take too long to compile"),  # 3.4 s at 49k tokens
        ("^.{1,128}$", "would take too long to compile"),  # 0.75 s at 49k tokens, 1.3 s as a regex
        (r"^(\w+ ){1,20}$", "would take too long to compile"),  # 1.9 s at 152k tokens
    ],
)
def test_costly_patterns_are_refused(pattern, message):
    with pytest.raises(CompileCostError, match=re.escape(message)) as caught:
        check(obj({"x": {"type": "string", "pattern": pattern}}, ["x"]))
    assert "the pattern of #/properties/x" in str(caught.value)
    with pytest.raises(CompileCostError, match=re.escape(message)):
        check_regex(pattern)


@pytest.mark.parametrize(
    "pattern", [r"^(\d{1,3}\.){3}\d{1,3}$", "^[a-z]{1,20}$", "^[A-Z][a-z]+-[0-9]{3}$", r"(\w+ ){1,3}", "a{2}b*"]
)
def test_cheap_patterns_pass(pattern):
    check_regex(pattern)


@pytest.mark.parametrize(
    "pattern", ["(unclosed", "a{", "a{1,", "[abc", "\\", "x)y", "(?<name>a)(?:b)(?=c)(?<=d)", "[]a]{3}"]
)
def test_the_regex_reader_never_fails_on_what_xgrammar_judges(pattern):
    assert regex_states(pattern) >= 0


def test_a_structural_tags_schemas_are_counted_together():
    """Forced tool calls: each tool's parameters are compiled into one grammar."""
    emails = ["from", "to"]
    params = obj(dict.fromkeys(emails, EMAIL), emails)  # about half the budget
    tag = {"type": "json_schema", "json_schema": params}
    check_structural_tag(json.dumps({"type": "structural_tag", "format": {"type": "tags", "tags": [tag]}}))
    with pytest.raises(CompileCostError, match="the tools' parameters would take too long"):
        check_structural_tag(json.dumps({"type": "structural_tag", "format": {"type": "tags", "tags": [tag] * 3}}))


def tool_parameters(index: int) -> dict:
    """An ordinary tool's parameters: a few properties, a bound and an enum."""
    return obj(
        {
            f"query_{index}": STRING,
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "mode": {"type": "string", "enum": ["fast", "slow", "auto"]},
            "path": {"type": ["string", "null"]},
        },
        [f"query_{index}", "limit", "mode", "path"],
        additionalProperties=False,
    )


def test_many_ordinary_tools_share_the_json_rules():
    """The tools' schemas compile into one grammar that holds the shared JSON rules once: 40 tools of 4 properties
    compiled in 17 ms at 49k tokens, where counting those rules per tool refused 27 tools of one property."""
    tools = [(f"tool_{i}", tool_parameters(i)) for i in range(64)]
    check_structural_tag(json.dumps({"type": "structural_tag", "format": qwen.forced(tools, True)}))
    single = [(f"tool_{i}", obj({"query": STRING}, ["query"], additionalProperties=False)) for i in range(64)]
    check_structural_tag(json.dumps({"type": "structural_tag", "format": qwen.forced(single, True)}))
    # Costly parameters still add up across tools.
    emails = ["from", "to"]
    costly = [(f"mail_{i}", obj(dict.fromkeys(emails, EMAIL), emails)) for i in range(3)]
    with pytest.raises(CompileCostError, match="the costliest part is the format email"):
        check_structural_tag(json.dumps({"type": "structural_tag", "format": qwen.forced(costly, True)}))


def test_groups_nested_past_the_limit_are_refused_not_overflowed():
    """The regex reader recurses per group: 3000 nested groups used to raise RecursionError (a 500), not a 400."""
    check_regex("(" * MAX_GROUP_DEPTH + "a" + ")" * MAX_GROUP_DEPTH)
    deep = "(" * 3000 + "a" + ")" * 3000
    message = f"groups nested {MAX_GROUP_DEPTH + 1} deep, at most {MAX_GROUP_DEPTH} are compiled"
    with pytest.raises(CompileCostError, match=re.escape(f"the regex: {message}")):
        check_regex(deep)
    with pytest.raises(CompileCostError, match=re.escape(f"the pattern of #/properties/x: {message}")):
        check(obj({"x": {"type": "string", "pattern": deep}}, ["x"]))
    with pytest.raises(ValidationError, match=re.escape(message)):
        StructuredOutput(kind="regex", text="(?:" * 500 + "a" + ")" * 500)


@pytest.mark.parametrize("depth", [200, 900, 5000])
def test_deeply_nested_schema_text_is_refused_not_overflowed(depth):
    """Past MAX_DEPTH the walk stops; past what Python's parser can read, the text is refused as too deep."""
    text = '{"items":' * depth + "{}" + "}" * depth
    with pytest.raises(CompileCostError, match=r"nested .*deep"):
        check_json_schema(text, True)
    tag = '{"type":"json_schema","json_schema":' + text + "}"
    with pytest.raises(CompileCostError, match=r"nested .*deep"):
        check_structural_tag(tag)


def test_structured_output_refuses_before_anything_compiles():
    with pytest.raises(ValidationError, match="1500 optional properties"):
        StructuredOutput.json_schema(obj({f"a{i}": STRING for i in range(1500)}))
    with pytest.raises(ValidationError, match="nested copies"):
        StructuredOutput(kind="regex", text="([a-z]{1,10}){1,100}")
    # Text that is not JSON is xgrammar's to refuse, with its own message.
    assert StructuredOutput(kind="json_schema", text="{not json").text == "{not json"


def test_prefix_count_matches_a_brute_force_one():
    rng = random.Random(0)
    for _ in range(500):
        names = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 8))]
        assert _num_prefixes(names) == len({name[:end] for name in names for end in range(len(name) + 1)})
