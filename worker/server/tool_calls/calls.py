"""What every family's parser shares: a parsed call, the scan of a call region, and reading one call's JSON object.

A parser reads a *region*: the output from where a family's calls begin (a marker such as `<tool_call>`, or the
first character of an output that is nothing but calls). It returns the calls that are complete and well-formed,
in order, and the text after the last of them. A streamed region is scanned again as it grows, from just after the
calls already read, so a call counts once its closing text has arrived; whatever cannot be read as a call (malformed
JSON, a name missing) ends the scan there and is handed back as plain text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class RegionScan:
    calls: list[ToolCall]
    rest: str  # the region's text after the last complete call: incomplete, malformed, or text the model added
    # Where `rest` starts in the region (0 when no call was read). A scan of the same region grown longer may start
    # there (`ToolCallFormat.scan(region, end)`) and read only the calls after these: a complete call never changes.
    end: int = 0
    closed: bool = False  # the region's closing text came after the calls: no call may follow


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def read_object(text: str, pos: int) -> tuple[dict[str, Any], int] | None:
    """The JSON object starting at `pos` and the position after it; None when there is none (yet)."""
    if not text.startswith("{", pos):
        return None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):  # too deep to be a call a client can use: plain text
        return None
    return (value, end) if isinstance(value, dict) else None


def as_call(value: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """`{"name": ..., <argument key>: {...}}` as a call, or None when it is not one. Arguments written as a JSON
    string of an object are accepted too; missing arguments are an empty object."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: object = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def read_calls(
    text: str,
    pos: int,
    argument_keys: tuple[str, ...],
    separator: str,
    closer: str | None = None,
    after_call: bool = False,
) -> tuple[list[ToolCall], int, bool]:
    """Calls written as JSON objects from `pos` on, `separator` between two (spaces around it allowed) and `closer`
    after the last, if the format has one; `after_call`: `pos` is just after a call read before (a resumed scan), so
    a separator or the closer comes first. -> the calls, where the text after them starts (past the closer when it
    was there, else right after the last call read, or `pos` when none was), and whether the closer was there."""
    calls: list[ToolCall] = []
    done = pos
    while True:
        if not after_call:
            found = read_object(text, skip_space(text, pos))
            call = as_call(found[0], argument_keys) if found else None
            if found is None or call is None:
                return calls, done, False
            calls.append(call)
            done = found[1]
        after_call = False
        pos = skip_space(text, done)
        if closer is not None and text.startswith(closer, pos):
            return calls, pos + len(closer), True
        if not text.startswith(separator, pos):
            return calls, done, False
        pos += len(separator)
