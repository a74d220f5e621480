"""One request's tokens and its progress through the cache (pure data, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.worker.engine.outputs import FinishReason
from tidal.worker.engine.sampling_params import SamplingParams

# Stands in token_ids for a token that a launched step samples but whose value the host has not read yet (async
# scheduling: the next step takes it from the device). Never a real token id, so any use of it as one is loud.
UNKNOWN_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two requests with equal tokens are still two sequences
class Sequence:
    """Token ids are prompt + output. `num_computed_tokens` of them have their K/V in the cache; the step that
    computes the rest (one chunk of a prefill, or the last token in decode) samples the next token."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    # Paged KV: the cache blocks holding this sequence's tokens, in order.
    block_table: list[int] = field(default_factory=list)
    # Prefix-cache hashes of this sequence's full, computed blocks (block i's hash chains block i-1's).
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Which of its request's samples this sequence is (n > 1: each sample is a sequence; see engine/fork.py).
    sample_index: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def drop_unknown_tokens(self) -> None:
        """Forget tokens still being sampled (the sequence ends before their values are read); they are last."""
        token_ids = self.token_ids
        while token_ids and token_ids[-1] == UNKNOWN_TOKEN:
            token_ids.pop()

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
