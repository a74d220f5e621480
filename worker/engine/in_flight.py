"""A launched step whose sampled tokens the host has not read yet: which request each sampled row belongs to and
where in its sequence the token goes. With async scheduling one such step is in flight while the next is launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from tidal.worker.engine.detokenizer import IncrementalDetokenizer
from tidal.worker.engine.outputs import TokenLogprob
from tidal.worker.engine.sampled_tokens import SampledTokens
from tidal.worker.engine.scheduler import SchedulerOutput
from tidal.worker.engine.sequence import Sequence
from tidal.worker.engine.text_stream import TextStream


@dataclass(slots=True)
class EngineRequest:
    """One request inside the engine: its sequence and its streamed text."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: TextStream
    length_limit: int  # the sequence ends on reaching this many tokens, whatever they are (max_tokens, max_model_len)
    # Prompt logprobs (sample 0 of a request asking): filed as the prefill's chunks are read (index = prompt position)
    # while due, and handed out with the first output; a recompute after a preemption is not handed out again.
    prompt_logprobs_due: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Structured output: its xgrammar GrammarMatcher, advanced by each token read; dropped when the sample ends.
    matcher: Any = None


class PendingToken(NamedTuple):  # one per sampled row per step: the cheapest immutable record
    # The request object itself, not its id: an aborted request's id may come back as a new request before
    # the step is read, and the token must not go to that one.
    request: EngineRequest
    token_index: int  # where in request.seq.token_ids the token goes (an UNKNOWN_TOKEN until it is read)


@dataclass(slots=True)
class InFlightStep:
    scheduled: SchedulerOutput
    pending: list[PendingToken]  # [S] one per sampled row, in the step's row order
    samples: SampledTokens
    prompt_positions: list[tuple[int, int]]  # [P] (seq_id, prompt position) of the step's prompt logprobs
    # The rows sampled with logprobs, in the order `samples.logprobs()` gives them; fixed when the sampling is queued
    # (a request ending before its step is read still has its row's logprobs there).
    logprob_rows: list[int] | None = None

    def sample_rows(self) -> dict[int, int]:
        """seq_id -> the row of this step's sampled tokens that holds the sequence's next token."""
        return {p.request.seq.seq_id: row for row, p in enumerate(self.pending)}
