"""Llama 3.x (its chat template's JSON tool calling): the output is nothing but
`{"name": ..., "parameters": {...}}` (or `"arguments"`), several separated by `;`, possibly after `<|python_tag|>`."""

from __future__ import annotations

from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, ToolCall, as_call, read_object, skip_space
from tidal.worker.server.tool_calls.format import ForcedTools, ToolCallFormat, tags_with_separator, tool_tag

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


def scan(region: str) -> RegionScan:
    calls: list[ToolCall] = []
    pos = skip_space(region, 0)
    if region.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
    done = 0
    while True:
        found = read_object(region, skip_space(region, pos))
        call = as_call(found[0], ("parameters", "arguments")) if found else None
        if found is None or call is None:
            break
        calls.append(call)
        done = found[1]
        pos = skip_space(region, done)
        if not region.startswith(SEPARATOR, pos):
            break
        pos += len(SEPARATOR)
    return RegionScan(calls, region[done:])


def forced(tools: ForcedTools, parallel: bool) -> dict[str, Any]:
    tags = [tool_tag(f'{{"name": "{name}", "parameters": ', schema, "}") for name, schema in tools]
    return tags_with_separator(tags, f"{SEPARATOR} ", parallel)


FORMAT = ToolCallFormat(name="llama", markers=(PYTHON_TAG,), leading=("{",), scan=scan, forced=forced)
