"""Tool calls read from a streamed output: fed in pieces (every split, one character at a time), the result equals
the whole output's parse, and no piece of a marker ever goes out as content."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.worker.server.tool_calls import llama, mistral, qwen
from tidal.worker.server.tool_calls.format import parse_output
from tidal.worker.server.tool_calls.stream import ToolCallStream

QWEN_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": "<tool"}}\n</tool_call>'
CASES = [
    (qwen.FORMAT, "Checking.\n" + QWEN_CALL + "\n" + QWEN_CALL.replace('"f"', '"g"')),
    (qwen.FORMAT, QWEN_CALL),
    (qwen.FORMAT, "a < b and <tool is not a marker, <tool_cal neither"),
    (qwen.FORMAT, "text <tool_call>\n{broken}\n</tool_call> more"),
    (qwen.FORMAT, QWEN_CALL + "\nand then some words"),
    (llama.FORMAT, '  {"name": "f", "parameters": {"x": [1, {"y": 2}]}}; {"name": "g", "parameters": {}}'),
    (llama.FORMAT, '<|python_tag|>{"name": "f", "parameters": {}}'),
    (llama.FORMAT, "Plain answer with {braces} inside"),
    (llama.FORMAT, '{"name": "f", "parameters": {"x": 1}'),
    (mistral.FORMAT, '[TOOL_CALLS][{"name": "a", "arguments": {"s": "]"}}, {"name": "b", "arguments": {}}]'),
    (mistral.FORMAT, "Plain [bracketed] text [TOOL_CAL"),
]


def _run(fmt, pieces):
    stream = ToolCallStream(fmt)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.content for d in deltas), [c for d in deltas for c in d.calls]


def _expected(fmt, text):
    whole = parse_output(fmt, text)
    return whole.content or "", [(c.name, c.arguments) for c in whole.calls]


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_one_character_at_a_time_equals_the_whole(fmt, text):
    content, calls = _run(fmt, list(text))
    expected_content, expected_calls = _expected(fmt, text)
    assert [(c.name, c.arguments) for c in calls] == expected_calls
    if expected_calls:
        assert content == expected_content
    else:  # no call: every character goes out as content, in order
        assert content == text


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_every_split_in_two_equals_the_whole(fmt, text):
    expected_content, expected_calls = _expected(fmt, text)
    for cut in range(len(text) + 1):
        content, calls = _run(fmt, [text[:cut], text[cut:]])
        assert [(c.name, c.arguments) for c in calls] == expected_calls, cut
        assert content == (expected_content if expected_calls else text), cut


def test_a_split_marker_is_held_back_then_released_when_it_is_not_one():
    stream = ToolCallStream(qwen.FORMAT)
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("_ca").content == ""
    assert stream.feed("t>").content == "<tool_cat>"


def test_a_call_goes_out_as_soon_as_it_is_complete():
    stream = ToolCallStream(qwen.FORMAT)
    first = stream.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_')
    assert first.calls == [] and first.content == ""
    done = stream.feed("call>\n<tool_call>")
    assert [c.name for c in done.calls] == ["f"] and stream.num_calls == 1


def test_llama_holds_leading_blanks_until_it_knows():
    stream = ToolCallStream(llama.FORMAT)
    assert stream.feed("  ").content == ""
    assert stream.feed("Hi").content == "  Hi"
    assert stream.feed(' {"name": "f", "parameters": {}}').content == ' {"name": "f", "parameters": {}}'


def _long_outputs():
    """(format, output) pairs of ~10k characters: many short calls, and one call with long arguments."""
    args = '{"x": [' + '{"y": "}{", "z": [1, {"w": 2}]}, ' * 300 + "{}]}"
    qwen_call = '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": 2}]}}\n</tool_call>'
    return [
        (llama.FORMAT, "; ".join(['{"name": "f", "parameters": {"a": [1, {"b": 2}]}}'] * 200)),
        (llama.FORMAT, '{"name": "f", "parameters": ' + args + "}"),
        (qwen.FORMAT, "\n".join([qwen_call] * 150)),
        (qwen.FORMAT, '<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"),
        (mistral.FORMAT, "[TOOL_CALLS][" + ", ".join(['{"name": "f", "arguments": {"a": [1, {"b": 2}]}}'] * 200) + "]"),
        (mistral.FORMAT, '[TOOL_CALLS][{"name": "f", "arguments": ' + args + "}]"),
    ]


@pytest.mark.parametrize(("fmt", "text"), _long_outputs())
def test_a_long_output_is_read_in_time_linear_in_its_length(fmt, text):
    """Each piece used to scan the whole region again (every call so far, and the call being written from its
    start): a 135 kB region streamed in 4-character pieces held the event loop, shared by every stream, for 37 s."""
    read = [0]

    def counting_scan(region, start=0):
        read[0] += len(region) - start  # what a scan reads: the region from where it starts
        return fmt.scan(region, start)

    stream = ToolCallStream(dataclasses.replace(fmt, scan=counting_scan))
    deltas = [stream.feed(text[i : i + 4]) for i in range(0, len(text), 4)] + [stream.finish()]
    assert [(c.name, c.arguments) for d in deltas for c in d.calls] == _expected(fmt, text)[1]
    assert read[0] <= 4 * len(text), f"scans read {read[0]} characters of a {len(text)}-character output"
