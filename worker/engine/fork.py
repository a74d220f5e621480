"""n samples of one prompt: one prefill, then n sequences that share the prompt's KV blocks (no torch here).

A request with n > 1 becomes n sequences up front, but only the first (the leader) is scheduled: it prefills the
prompt alone. The others (followers) wait here until the step in which the leader samples its first token is
launched; then each follower is forked from the leader: it shares the leader's full blocks (reference counts) and
gets its own copy of the partly filled last block, which the next token of each would write. The same step samples a
first token for every follower from the leader's logits row (the engine repeats that row), so from the next step on
the n sequences are n ordinary running sequences, each with its own sampler state (seed + index when seeded).

A follower that finds no free block for its copy is queued as a sequence of its own instead: it prefills later, its
full blocks usually coming back through the prefix cache.

Requests with n = 1 never reach this module: the step pays one empty-dict check for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.in_flight import EngineRequest, PendingToken
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler
from tidal.worker.engine.sequence import SequenceStatus

_SEED_MODULUS = 2**64  # the sampler's seeds are unsigned 64-bit


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s parameters: a seeded request's samples must differ, so each adds its index to the seed
    (sample i of a request seeded s draws what a single request seeded s + i draws)."""
    if index == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + index) % _SEED_MODULUS})


@dataclass
class ForkedSamples:
    """What joining followers to a step adds to it."""

    rows: list[int] = field(default_factory=list)  # [F] the sampled row (of the step's logits) each follower repeats
    pending: list[PendingToken] = field(default_factory=list)  # [F] the followers' first tokens, in row order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks to copy


class Forks:
    """Followers waiting for their leader's first token, by the leader's seq_id."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler) -> None:
        self._block_manager = block_manager
        self._scheduler = scheduler
        self._waiting: dict[int, list[EngineRequest]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, leader: EngineRequest, followers: list[EngineRequest]) -> None:
        self._waiting[leader.seq.seq_id] = followers

    def drop(self, seq_id: int) -> None:
        """Forget the followers waiting on `seq_id` (the request ends; the caller finishes them)."""
        self._waiting.pop(seq_id, None)

    def join(self, pending: list[PendingToken]) -> ForkedSamples | None:
        """Fork the followers of every leader that samples (its first token) in a step just launched: `pending` are
        that step's sampled rows, and the leaders' tokens already count as computed. -> what the step must add, or
        None when no leader samples in it."""
        forked: ForkedSamples | None = None
        for row, p in enumerate(pending):
            followers = self._waiting.pop(p.request.seq.seq_id, None)
            if followers is None:
                continue
            forked = forked or ForkedSamples()
            for follower in followers:
                self._fork(p, row, follower, forked)
        return forked

    def _fork(self, leader: PendingToken, row: int, follower: EngineRequest, forked: ForkedSamples) -> None:
        parent, child = leader.request.seq, follower.seq
        if not self._block_manager.can_fork(parent):
            self._scheduler.add(child)  # its own prefill later
            return
        child.token_ids = list(parent.token_ids)  # the prompt, then the token this step samples (unknown yet)
        copy = self._block_manager.fork(parent, child)
        if copy is not None:
            forked.copies.append(copy)
        child.status = SequenceStatus.RUNNING
        self._scheduler.running.append(child)  # the newest: the first to be preempted, as a new arrival would be
        forked.rows.append(row)
        forked.pending.append(PendingToken(follower, leader.token_index))
