"""Qwen2 and Qwen3 (their chat templates' format): each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several one after another, after optional text."""

from __future__ import annotations

import json
from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, ToolCall, as_call, skip_space
from tidal.worker.server.tool_calls.format import ForcedTools, ToolCallFormat, tags_with_separator, tool_tag

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def scan(region: str, start: int = 0) -> RegionScan:
    calls: list[ToolCall] = []
    done = start  # end of the last complete call (`start`: one read before, or the region's start)
    while True:
        pos = skip_space(region, done)
        if not region.startswith(OPEN, pos):
            break
        close = region.find(CLOSE, pos)
        if close < 0:
            break
        try:
            call = as_call(json.loads(region[pos + len(OPEN) : close]), ("arguments", "parameters"))
        except (json.JSONDecodeError, RecursionError):  # malformed or too deep: the text stays content
            call = None
        if call is None:
            break
        calls.append(call)
        done = close + len(CLOSE)
    return RegionScan(calls, region[done:], done)


def forced(tools: ForcedTools, parallel: bool) -> dict[str, Any]:
    tags = [tool_tag(f'{OPEN}\n{{"name": "{name}", "arguments": ', schema, f"}}\n{CLOSE}") for name, schema in tools]
    return tags_with_separator(tags, "\n", parallel)


FORMAT = ToolCallFormat(name="qwen", markers=(OPEN,), leading=(), scan=scan, ends_with=CLOSE[-1], forced=forced)
