"""Reading tool calls out of an output as it streams: text goes out as content until a call region starts; a call
goes out once it is complete; text that might be the start of a marker is held back until it is clear either way.

The result equals `parse_output` of the whole text: the same calls, and the same content (blank content around the
calls left out), only cut into deltas.

Each piece costs time in its own length, not the region's (this runs on the event loop, which every stream shares):
a scan starts after the calls already read, and runs only for a piece that may end a call (`_ObjectDepth`, and the
format's last character of a call). Scanning the whole region for every piece held the loop for 37 s over one 135 kB
call streamed in 4-character pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.worker.server.tool_calls.calls import ToolCall
from tidal.worker.server.tool_calls.format import ToolCallFormat, region_start


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # calls completed by this delta, in order


class ToolCallStream:
    """One choice's output, fed in pieces (`feed`), then ended (`finish`)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._pending = ""  # text state: held back, not yet sent
        self._region: str | None = None  # once a region started: all of it so far
        self._num_sent_calls = 0
        self._calls_end = 0  # in the region: just after the last call sent (0: none yet), where a scan starts
        self._closed = False  # the region's closing text came: no call may follow
        self._depth = _ObjectDepth()
        self._may_lead = True  # nothing but blanks so far: a `leading` start still counts
        self._blank_before = ""  # blanks held back before the region, sent only if it holds no call

    @property
    def num_calls(self) -> int:
        return self._num_sent_calls

    def feed(self, text: str) -> StreamDelta:
        if self._region is not None:
            self._region += text
            return StreamDelta(calls=self._new_calls(text))
        self._pending += text
        start = region_start(self._fmt, self._pending, self._may_lead)
        if start is not None:
            before, self._region, self._pending = self._pending[:start], self._pending[start:], ""
            if self._may_lead and not before.strip():  # blanks alone before the calls are no content
                before, self._blank_before = "", before
            return StreamDelta(content=before, calls=self._new_calls(self._region))
        keep = self._held_back(self._pending)
        sent, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        if sent.strip():
            self._may_lead = False
        return StreamDelta(content=sent)

    def finish(self) -> StreamDelta:
        """The rest, once the output has ended."""
        if self._region is None:
            pending, self._pending = self._pending, ""
            return StreamDelta(content=pending)
        calls = self._new_calls("", ended=True)
        region, self._region = self._region, ""
        if self._num_sent_calls == 0:  # no call could be read: the region was text after all
            return StreamDelta(content=self._blank_before + region)
        rest = region[self._calls_end :]
        return StreamDelta(content=rest if rest.strip() else "", calls=calls)

    def _new_calls(self, text: str, ended: bool = False) -> list[ToolCall]:
        """The calls completed by `text`, the region's newest part (`ended`: the output has ended)."""
        may_end_a_call = self._depth.feed(text) and self._fmt.ends_with in text
        if self._region is None or self._closed or not (may_end_a_call or ended):
            return []
        scan = self._fmt.scan(self._region, self._calls_end)
        self._calls_end, self._closed = scan.end, scan.closed
        self._num_sent_calls += len(scan.calls)
        return scan.calls

    def _held_back(self, text: str) -> int:
        """How much of `text`'s end might still become a region's start."""
        if self._may_lead and not text.strip():
            return len(text)  # blanks before what may be calls and nothing else
        longest = 0
        for marker in self._fmt.markers:
            for size in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:size]):
                    longest = size
                    break
        return longest


class _ObjectDepth:
    """How deep in JSON objects a region's text is, fed in pieces (braces in strings do not count). Every family
    writes a call as a JSON object, followed by closing text (Qwen's `</tool_call>`) or not, so a call can have ended
    only in a piece with a character after which the depth is 0: one that closes an object or lies between them.
    A call being written (depth 1 or more) is not read again for each of its pieces.

    Strings are only tracked inside objects: a quote between them (text after the calls) is not JSON, and no call can
    follow such text anyway."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the previous character was a backslash inside a string

    def feed(self, text: str) -> bool:
        """-> whether the depth was 0 after some character of `text`."""
        outside = False
        for char in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == "{":
                self._depth += 1
            elif char == "}" and self._depth:
                self._depth -= 1
            elif char == '"' and self._depth:
                self._in_string = True
            outside = outside or self._depth == 0
        return outside
