"""One request's streamed text: detokenized deltas with stop strings applied.

Text that might be the start of a stop string is held back until it is clear, so a client never receives
part of a stop string it should not see.
"""

from __future__ import annotations

from tidal.worker.engine.detokenizer import IncrementalDetokenizer
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.stop_strings import StopStrings


class TextStream:
    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams) -> None:
        self._detokenizer = detokenizer
        self._stops = StopStrings(list(params.stop)) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self.text = ""  # all text decoded so far (may run past a stop string); kept only with stop strings
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def push(self, new_token_ids: list[int]) -> str:
        """-> the new text to hand out; sets `stopped` when a stop string appeared."""
        return self.add_text(self._detokenizer.push(new_token_ids))

    def add_text(self, new_text: str, may_stop: bool = True) -> str:
        """The same as `push`, for tokens whose text the detokenizer already gave (batched over a step).
        `may_stop` False (min_tokens not reached yet): a stop string in the text so far does not count; text that
        could still become one is held back all the same."""
        if not new_text:
            return ""  # nothing new can complete a stop string or release held-back text
        if self._stops is None:  # nothing is ever held back: skip keeping the whole text (a copy per token)
            return new_text
        self.text += new_text
        hit = self._stops.feed(new_text, may_stop)
        if hit is not None:
            index, stop = hit
            self.stopped = True
            return self._release(index + (len(stop) if self._include_stop else 0))
        return self._release(len(self.text) - self._stops.partial_len)

    def flush(self) -> str:
        """-> text held back, to hand out when the request ends for a reason other than a stop string."""
        if self.stopped:
            return ""
        if self._stops is None:
            return self._detokenizer.flush()
        self.text += self._detokenizer.flush()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
