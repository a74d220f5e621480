"""A family's tool-call format as data (how its calls start, how a region is read, how calls are forced), and the
reading of a whole output: the text before the calls, the calls, and what follows them.

Where a region may start: at any `markers` occurrence (Qwen's `<tool_call>`), or, for a family whose calls are the
whole output, at a `leading` text that comes first (after blanks: Llama's `{`). An output whose region holds no
well-formed call is all content, so a model that merely writes JSON, or writes a call badly, still answers in text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.worker.server.tool_calls.calls import RegionScan, ToolCall

# (name, the parameters' JSON schema) of each tool a forced call may use
ForcedTools = list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    markers: tuple[str, ...]  # start a region wherever they appear
    leading: tuple[str, ...]  # start a region only as the output's first non-blank text
    # A region's calls and the text after them; from 0, or from the `end` of an earlier scan of a shorter prefix of
    # the region that read calls (a stream's: only the calls after those are read again).
    scan: Callable[[str, int], RegionScan]
    ends_with: str  # the last character of a call's text: a streamed piece without it completes no call
    # The xgrammar structural-tag format that admits only calls of these tools (one, or several if parallel).
    forced: Callable[[ForcedTools, bool], dict[str, Any]]


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the calls are all there is
    calls: list[ToolCall]


def region_start(fmt: ToolCallFormat, text: str, may_lead: bool = True) -> int | None:
    """Where the first call region of `text` starts; `may_lead`: `text` begins the output (nothing but blanks came
    before it), so a `leading` start counts."""
    if may_lead:
        first = len(text) - len(text.lstrip())
        if text.startswith(fmt.leading, first) and fmt.leading:
            return first
    found = [at for at in (text.find(marker) for marker in fmt.markers) if at >= 0]
    return min(found) if found else None


def parse_output(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    """A whole output: its calls, and as content the text before them plus anything after the last one."""
    start = region_start(fmt, text)
    if start is None:
        return ParsedOutput(content=text, calls=[])
    scan = fmt.scan(text[start:], 0)
    if not scan.calls:
        return ParsedOutput(content=text, calls=[])
    content = text[:start] + (scan.rest if scan.rest.strip() else "")
    return ParsedOutput(content=content if content.strip() else None, calls=scan.calls)


def tool_tag(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    """A structural-tag `tag`: fixed text, the arguments as JSON of `schema`, fixed text. One blank at most between
    JSON tokens: a model could otherwise spend its whole budget on blanks inside the braces."""
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def tags_with_separator(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """At least one of `tags`; more, separated by `separator`, only if `parallel`."""
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
