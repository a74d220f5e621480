"""Each family's tool-call parser on whole outputs: the calls, the text around them, and malformed calls as content."""

from __future__ import annotations

import json

import pytest

from tidal.worker.server.tool_calls import llama, mistral, qwen
from tidal.worker.server.tool_calls.families import choose_format
from tidal.worker.server.tool_calls.format import parse_output


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_qwen_calls_after_text():
    text = (
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_output(qwen.FORMAT, text)
    assert _calls(parsed) == [("weather", {"city": "Paris"}), ("time", {})]
    assert parsed.content == "Let me look.\n"
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id


def test_qwen_only_calls_have_no_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>\n'
    parsed = parse_output(qwen.FORMAT, text)
    assert parsed.content is None and _calls(parsed) == [("f", {"a": [1, 2]})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',  # malformed JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
        "plain text with no calls",
    ],
)
def test_qwen_malformed_calls_are_plain_content(text):
    parsed = parse_output(qwen.FORMAT, text)
    assert parsed.calls == [] and parsed.content == text


def test_qwen_a_good_call_then_a_bad_one_keeps_the_bad_one_as_content():
    good = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    bad = '\n<tool_call>\n{"name": oops}\n</tool_call>'
    parsed = parse_output(qwen.FORMAT, "Hi " + good + bad)
    assert _calls(parsed) == [("f", {})] and parsed.content == "Hi " + bad


def test_llama_json_calls_separated_by_semicolons():
    text = '{"name": "weather", "parameters": {"city": "Rome"}}; {"name": "time", "arguments": {"tz": "UTC"}}'
    parsed = parse_output(llama.FORMAT, text)
    assert _calls(parsed) == [("weather", {"city": "Rome"}), ("time", {"tz": "UTC"})] and parsed.content is None


def test_llama_python_tag_and_blanks_before_the_call():
    parsed = parse_output(llama.FORMAT, '  <|python_tag|>{"name": "f", "parameters": {"x": 1}}')
    assert _calls(parsed) == [("f", {"x": 1})] and parsed.content is None


@pytest.mark.parametrize(
    "text",
    [
        'The answer is {"name": "f", "parameters": {}}',  # a call only counts as the whole output
        '{"name": "f", "parameters": {"x": 1}',  # unclosed
        '{"title": "not a call"}',
        "[1, 2, 3]",
    ],
)
def test_llama_text_and_malformed_calls_are_plain_content(text):
    parsed = parse_output(llama.FORMAT, text)
    assert parsed.calls == [] and parsed.content == text


def test_llama_arguments_as_a_json_string_are_accepted():
    parsed = parse_output(llama.FORMAT, '{"name": "f", "parameters": "{\\"x\\": 2}"}')
    assert _calls(parsed) == [("f", {"x": 2})]


def test_mistral_marker_and_array():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]'
    parsed = parse_output(mistral.FORMAT, text)
    assert _calls(parsed) == [("a", {"q": "x"}), ("b", {})] and parsed.content is None


def test_mistral_without_the_special_token_and_after_text():
    assert _calls(parse_output(mistral.FORMAT, ' [{"name": "a", "arguments": {}}]')) == [("a", {})]
    parsed = parse_output(mistral.FORMAT, 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert _calls(parsed) == [("a", {})] and parsed.content == "Sure. "


@pytest.mark.parametrize("text", ["[TOOL_CALLS][{bad json}]", "[TOOL_CALLS]nothing", '[{"no": "name"}]', "[1]"])
def test_mistral_malformed_calls_are_plain_content(text):
    parsed = parse_output(mistral.FORMAT, text)
    assert parsed.calls == [] and parsed.content == text


def test_the_architecture_picks_the_format_unless_the_operator_names_one():
    assert choose_format("auto", "qwen") is qwen.FORMAT
    assert choose_format("llama", "qwen") is llama.FORMAT
    assert choose_format("auto", None) is None
