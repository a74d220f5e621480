"""What the sampler knows of a step's sampled rows, as columns (pure, no torch).

Columns rather than a record per row: a step of a few hundred plain rows then costs the sampler two lists the engine
has anyway. The columns that only logit edits, penalties and grammars read are filled only when a live request uses
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tidal.worker.engine.sampling_params import SamplingParams


class SampleBatch(NamedTuple):
    params: list[SamplingParams]  # [S]
    seq_ids: list[int]  # [S]
    # [S] tokens before each row's sampled one (prompt + generated so far, the last perhaps still on the device): the
    # new token's index in its sequence. Known at launch, so no row waits for the previous step's values.
    num_tokens: list[int] | None = None
    prompts: list[list[int]] | None = None  # [S] each row's prompt token ids
    # Rows whose logprobs are returned, ascending; None (no live request asks for them) skips the stage.
    logprob_rows: list[int] | None = None
    # [S] each row's grammar matcher (an xgrammar GrammarMatcher, None for an unconstrained row), as of the tokens
    # already read: only while a live request has a structured output (the engine then reads each step before the
    # next is launched).
    matchers: list[Any] | None = None

    @property
    def has_control_columns(self) -> bool:
        """Whether the columns for logit edits and penalties are here (some row may use them)."""
        return self.num_tokens is not None and self.prompts is not None

    def num_output_tokens(self, row: int) -> int:
        """Tokens the row's sequence generated before this step's."""
        return self._num_tokens()[row] - len(self.prompt(row))

    def prompt(self, row: int) -> list[int]:
        if self.prompts is None:
            raise ValueError("this batch was made without its control columns")
        return self.prompts[row]

    def _num_tokens(self) -> list[int]:
        if self.num_tokens is None:
            raise ValueError("this batch was made without its control columns")
        return self.num_tokens
