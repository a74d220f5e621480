"""Reading tool calls out of an output as it streams: text goes out as content until a call region starts; a call
goes out once it is complete; text that might be the start of a marker is held back until it is clear either way.

The result equals `parse_output` of the whole text: the same calls, and the same content (blank content around the
calls left out), only cut into deltas.
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
        self._may_lead = True  # nothing but blanks so far: a `leading` start still counts
        self._blank_before = ""  # blanks held back before the region, sent only if it holds no call

    @property
    def num_calls(self) -> int:
        return self._num_sent_calls

    def feed(self, text: str) -> StreamDelta:
        if self._region is not None:
            self._region += text
            return StreamDelta(calls=self._new_calls(self._region))
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
        region, self._region = self._region, ""
        calls = self._new_calls(region)
        if self._num_sent_calls == 0:  # no call could be read: the region was text after all
            return StreamDelta(content=self._blank_before + region)
        rest = self._fmt.scan(region).rest
        return StreamDelta(content=rest if rest.strip() else "", calls=calls)

    def _new_calls(self, region: str) -> list[ToolCall]:
        calls = self._fmt.scan(region).calls
        new = calls[self._num_sent_calls :]
        self._num_sent_calls = len(calls)
        return new

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
