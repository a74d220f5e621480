"""Mistral and Mixtral (their chat templates' format): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`[TOOL_CALLS]` is a special token, which the detokenizer leaves out of the text, so an output that is nothing but
such an array counts as calls too. Forced calls spell the marker out as text.
"""

from __future__ import annotations

from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, ToolCall, as_call, read_object, skip_space
from tidal.worker.server.tool_calls.format import ForcedTools, ToolCallFormat, tags_with_separator, tool_tag

MARKER = "[TOOL_CALLS]"


def scan(region: str) -> RegionScan:
    calls: list[ToolCall] = []
    pos = skip_space(region, 0)
    if region.startswith(MARKER, pos):
        pos = skip_space(region, pos + len(MARKER))
    if not region.startswith("[", pos):
        return RegionScan(calls, region)
    pos += 1
    done = 0
    while True:
        found = read_object(region, skip_space(region, pos))
        call = as_call(found[0], ("arguments", "parameters")) if found else None
        if found is None or call is None:
            break
        calls.append(call)
        done = found[1]
        pos = skip_space(region, done)
        if region.startswith("]", pos):
            done = pos + 1
            break
        if not region.startswith(",", pos):
            break
        pos += 1
    return RegionScan(calls, region[done:])


def forced(tools: ForcedTools, parallel: bool) -> dict[str, Any]:
    tags = [tool_tag(f'{{"name": "{name}", "arguments": ', schema, "}") for name, schema in tools]
    calls = tags_with_separator(tags, ", ", parallel)
    return {"type": "sequence", "elements": [_text(f"{MARKER}["), calls, _text("]")]}


def _text(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


FORMAT = ToolCallFormat(name="mistral", markers=(MARKER,), leading=("[",), scan=scan, forced=forced)
