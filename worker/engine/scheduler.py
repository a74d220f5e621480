"""Continuous batching: decide which sequences run in the next step and how many tokens each computes.

Each step first serves running sequences in arrival order (decodes and unfinished prefill chunks), then admits
waiting ones while the token budget, the sequence limit and the free blocks allow; so prefills and decodes
share a step. Long prompts are prefilled in chunks that fit the budget. When a running sequence needs a block
and none is free, the newest running sequence is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed (its full blocks usually come back through the prefix cache).

With async scheduling a step is scheduled while the one before still runs: the sequences it samples for carry an
UNKNOWN_TOKEN as their last token (a decode reads it on the device), and those that must end by length once it is
read are retired first, so the schedule is the one made after reading.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sequence import UNKNOWN_TOKEN, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: token_ids[num_computed : num_computed + num_new_tokens]
    # Only the chunk that reaches the last token produces logits worth sampling (decided when scheduled, before
    # the step advances the sequence).
    will_sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled = out.scheduled
        budget = self.limits.max_num_batched_tokens
        max_num_seqs = self.limits.max_num_seqs
        try_append = self.block_manager.try_append
        # Running sequences first, oldest first; the newest are the preemption victims. queue[next_i:end] are
        # the ones not yet served (an index, not pop(0): that would move the whole list for every sequence).
        queue = self.running
        self.running = running = []
        next_i, end = 0, len(queue)
        while next_i < end and budget > 0 and len(scheduled) < max_num_seqs:
            seq = queue[next_i]
            next_i += 1
            num_uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            num_new = num_uncomputed if num_uncomputed < budget else budget
            while not try_append(seq, num_new):
                if next_i < end:
                    end -= 1
                    victim = queue[end]
                else:
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                running.append(seq)
                scheduled.append(ScheduledSequence(seq, num_new, num_new == num_uncomputed))
                budget -= num_new
        running.extend(queue[next_i:end])  # left over by the budget or the sequence limit; they keep their blocks
        if out.preempted:
            return out  # don't admit new work into a cache that just ran out
        while self.waiting and budget > 0 and len(running) < max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            num_uncomputed = seq.num_uncomputed_tokens
            num_new = min(num_uncomputed, budget)
            running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new, num_new == num_uncomputed))
            budget -= num_new
        return out

    def on_step_launched(self, out: SchedulerOutput) -> None:
        """Advance the scheduled sequences as their step is launched: its tokens count as computed, and each
        sampling sequence gets an UNKNOWN_TOKEN where its sampled token goes once it is read."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if item.will_sample:
                seq.token_ids.append(UNKNOWN_TOKEN)

    def commit(self, out: SchedulerOutput) -> None:
        """Register the prefix hashes of the blocks a launched step filled; call it once the tokens it computed
        are all known (not UNKNOWN_TOKEN), else the blocks holding unknown ones wait for a later commit."""
        commit = self.block_manager.commit
        for item in out.scheduled:
            if item.seq.status is not SequenceStatus.FINISHED:  # a finished sequence's blocks are gone
                commit(item.seq)

    def on_step_done(self, out: SchedulerOutput, sampled: dict[int, int]) -> None:
        """A step that ran and was read at once (tests, tools): advance the scheduled sequences and append the
        token sampled for each (`sampled`: seq_id -> token)."""
        commit = self.block_manager.commit
        for item in out.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_new_tokens
            commit(seq)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.token_ids.append(token)

    def retire(self, seqs: list[Sequence]) -> None:
        """Take running sequences that must end once their last (unknown) token is read out of the batch and free
        their blocks now, as if they had ended already: the next step is scheduled exactly as if they had. The
        blocks may go to another sequence in that step while the step that samples these ones' last tokens still
        runs on the device and reads them; safe, because the device runs the steps in the order they were launched.
        """
        gone = set(seqs)  # identity: Sequence compares and hashes by object
        self.running = [seq for seq in self.running if seq not in gone]
        for seq in seqs:
            self.block_manager.free(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        # Membership, not status: after a step that failed half-way the two may disagree.
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish(reason)  # type: ignore[arg-type]
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
