"""Llama 3.x (its chat template's JSON tool calling): the output is nothing but
`{"name": ..., "parameters": {...}}` (or `"arguments"`), several separated by `;`, possibly after `<|python_tag|>`."""

from __future__ import annotations

from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, read_calls, skip_space
from tidal.worker.server.tool_calls.format import ForcedTools, ToolCallFormat, tags_with_separator, tool_tag

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


_ARGUMENTS = ("parameters", "arguments")


def scan(region: str, start: int = 0) -> RegionScan:
    if start:  # just after a call read before
        calls, end, _ = read_calls(region, start, _ARGUMENTS, SEPARATOR, after_call=True)
        return RegionScan(calls, region[end:], end)
    pos = skip_space(region, 0)
    if region.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
    calls, end, _ = read_calls(region, pos, _ARGUMENTS, SEPARATOR)
    return RegionScan(calls, region[end:], end) if calls else RegionScan([], region)


def forced(tools: ForcedTools, parallel: bool) -> dict[str, Any]:
    tags = [tool_tag(f'{{"name": "{name}", "parameters": ', schema, "}") for name, schema in tools]
    return tags_with_separator(tags, f"{SEPARATOR} ", parallel)


FORMAT = ToolCallFormat(name="llama", markers=(PYTHON_TAG,), leading=("{",), scan=scan, ends_with="}", forced=forced)
