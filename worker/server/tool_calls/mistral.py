"""Mistral and Mixtral (their chat templates' format): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`[TOOL_CALLS]` is a special token, which the detokenizer leaves out of the text, so an output that is nothing but
such an array counts as calls too. Forced calls spell the marker out as text.
"""

from __future__ import annotations

from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, read_calls, skip_space
from tidal.worker.server.tool_calls.format import ForcedTools, ToolCallFormat, tags_with_separator, tool_tag

MARKER = "[TOOL_CALLS]"


_ARGUMENTS = ("arguments", "parameters")


def scan(region: str, start: int = 0) -> RegionScan:
    if start:  # just after a call read before
        calls, end, closed = read_calls(region, start, _ARGUMENTS, ",", closer="]", after_call=True)
        return RegionScan(calls, region[end:], end, closed)
    pos = skip_space(region, 0)
    if region.startswith(MARKER, pos):
        pos = skip_space(region, pos + len(MARKER))
    if not region.startswith("[", pos):
        return RegionScan([], region)
    calls, end, closed = read_calls(region, pos + 1, _ARGUMENTS, ",", closer="]")
    return RegionScan(calls, region[end:], end, closed) if calls else RegionScan([], region)


def forced(tools: ForcedTools, parallel: bool) -> dict[str, Any]:
    tags = [tool_tag(f'{{"name": "{name}", "arguments": ', schema, "}") for name, schema in tools]
    calls = tags_with_separator(tags, ", ", parallel)
    return {"type": "sequence", "elements": [_text(f"{MARKER}["), calls, _text("]")]}


def _text(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


FORMAT = ToolCallFormat(name="mistral", markers=(MARKER,), leading=("[",), scan=scan, ends_with="}", forced=forced)
