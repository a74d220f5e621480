"""What the operator remembers about each model from one pass to the next: one object per model, in one map.

The planner keeps no state, and whatever must survive an operator restart lives in the model's status. What is
kept here are hints and clocks a fresh process can do without: back-off streaks, when the current weight roll began
(for its duration metric), the checksums already read, weight updates the worker refused (which `/state` does
not report), since when and how many times in a row each rank's `/state` has gone unanswered and its last answer
(the status holds it through a brief silence), the `/state` call of each rank that missed its last one (left
running from one pass to the next), each group's last epoch sent with its answers
(a fresh process goes by the epochs the workers report), and what the API server said of the pods the model is to
get (a fresh process asks again). Holding all of it in one `ModelMemory` means a deleted model is forgotten by one
`forget(key)`, which also stops the reconfigure and `/state` calls still running for it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from tidal.contract.control_api import GroupReconfigureResult, WorkerState
from tidal.operator.builders.weights import Weights
from tidal.operator.planner.observed import EpochRefusal, SentEpoch, UpdateFailure
from tidal.operator.runtime.queue import Key

# A streak stops growing here: 2.0**streak overflows a float after 1023, and 2**16 s is far past any back-off cap.
MAX_STREAK = 16


@dataclass(frozen=True)
class RollStart:
    """The weights version being rolled out, and when (time.monotonic()) its first update was sent."""

    version: str
    started: float


@dataclass
class EpochFlight:
    """One epoch sent to a replica's members (times from time.monotonic()), and each member's answer so far."""

    epoch: int
    members: list[int]
    coordinator_rank: int
    sent_at: float
    sent_wall: datetime
    results: dict[int, GroupReconfigureResult] = field(default_factory=dict)
    refusals: dict[int, EpochRefusal] = field(default_factory=dict)
    last_answer_at: float | None = None
    task: asyncio.Task[None] | None = None

    @property
    def answered(self) -> bool:
        return len(self.results) + len(self.refusals) >= len(self.members)

    @property
    def applied(self) -> bool:
        return not self.refusals and sorted(self.results) == sorted(self.members)

    def record(self, rank: int, answer: GroupReconfigureResult | EpochRefusal) -> None:
        if isinstance(answer, EpochRefusal):
            self.refusals[rank] = answer
        else:
            self.results[rank] = answer
        self.last_answer_at = time.monotonic()

    def as_sent(self, now: float) -> SentEpoch:
        """What the planner is told: ages from the monotonic clock, the applied time as wall-clock."""
        answered = self.answered
        last = self.last_answer_at
        applied_at = None
        if answered and self.applied and last is not None:
            applied_at = self.sent_wall + timedelta(seconds=last - self.sent_at)
        return SentEpoch(
            epoch=self.epoch,
            members=self.members,
            coordinator_rank=self.coordinator_rank,
            sent_at=self.sent_wall,
            age_s=max(0.0, now - self.sent_at),
            answered=answered,
            answered_age_s=max(0.0, now - last) if answered and last is not None else None,
            applied_at=applied_at,
            refusals=[self.refusals[r] for r in sorted(self.refusals)],
        )

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


@dataclass
class Silence:
    """A rank's `/state` calls in a row that got no answer."""

    since: float  # time.monotonic() of the first
    misses: int = 1


@dataclass(frozen=True)
class StateAnswer:
    """A rank's last `/state` answer and its weights' checksum: what the status holds while it briefly misses."""

    state: WorkerState
    checksum: str | None


# A `/state` call that outlives the pass that made it: the rank's answer and when it came (time.monotonic()).
StateProbe = asyncio.Task[tuple[WorkerState, float]]


@dataclass(frozen=True)
class PodVerdict:
    """What the API server said of one pod manifest (by spec hash): None admits it, else its refusal message."""

    refusal: str | None
    at: float  # time.monotonic()


def wall_clock() -> datetime:
    return datetime.now(UTC)


@dataclass
class ModelMemory:
    error_streak: int = 0  # passes in a row that raised
    failed_calls_streak: int = 0  # passes in a row whose every worker call failed
    roll: RollStart | None = None
    # (pod UID, weights version, source) -> checksum: the digest of one version read from one directory in one
    # process cannot change, and hashing a large checkpoint on every pass would be wasteful. (The same version from
    # another directory is other weights; a worker that reports no source has None.)
    checksums: dict[tuple[str, str, str | None], str] = field(default_factory=dict)
    # pod -> the last weight update it refused (cleared by its next successful update, or once the spec names other
    # weights: `keep_update_failures_for`).
    update_failures: dict[str, UpdateFailure] = field(default_factory=dict)
    # pod UID -> its `/state` calls in a row that got no answer, and since when.
    state_misses: dict[str, Silence] = field(default_factory=dict)
    # pod UID -> its last `/state` answer (the status holds it for a few misses: `facts.HOLD_MISSED_READS`).
    state_answers: dict[str, StateAnswer] = field(default_factory=dict)
    # pod UID -> the `/state` call of a rank that missed its last one, running until it ends by its own timeout (each
    # pass waits for it only briefly: `WorkerFleet.observe`); at most one per process.
    state_probes: dict[str, StateProbe] = field(default_factory=dict)
    # replica -> the last epoch sent to its group.
    epochs: dict[int, EpochFlight] = field(default_factory=dict)
    # spec hash -> the API server's verdict on the pod built with it (a dry run, or a create it refused).
    pod_verdicts: dict[str, PodVerdict] = field(default_factory=dict)

    def sent_epochs(self) -> dict[int, SentEpoch]:
        now = time.monotonic()
        return {replica: flight.as_sent(now) for replica, flight in self.epochs.items()}

    def start_epoch(self, replica: int, flight: EpochFlight) -> None:
        """A newer epoch supersedes the one in flight: the older calls are dropped (the workers drop it too)."""
        previous = self.epochs.get(replica)
        if previous is not None:
            previous.cancel()
        self.epochs[replica] = flight

    def stop(self) -> None:
        for flight in self.epochs.values():
            flight.cancel()
        for probe in self.state_probes.values():
            probe.cancel()

    def record_pod_verdict(self, spec_hash: str, refusal: str | None) -> None:
        self.pod_verdicts[spec_hash] = PodVerdict(refusal, time.monotonic())

    def count_error(self) -> int:
        self.error_streak = min(self.error_streak + 1, MAX_STREAK)
        return self.error_streak

    def count_failed_calls(self) -> int:
        self.failed_calls_streak = min(self.failed_calls_streak + 1, MAX_STREAK)
        return self.failed_calls_streak

    def keep_update_failures_for(self, desired: Weights) -> None:
        """A refused update matters while the spec asks for those weights. Once it names others, the hold in the
        status ends; a later return to them is a new roll, so the refusal must not outlive the hold here."""
        self.update_failures = {
            pod: failed
            for pod, failed in self.update_failures.items()
            if desired.same_as(Weights(failed.version, failed.source))
        }

    def keep_checksums_of(self, pod_uids: set[str]) -> None:
        """Drop the checksums (and `/state` misses, answers and calls still running) of processes that are gone, so
        the memory stays as small as the model."""
        self.checksums = {key: value for key, value in self.checksums.items() if key[0] in pod_uids}
        self.state_misses = {uid: silence for uid, silence in self.state_misses.items() if uid in pod_uids}
        self.state_answers = {uid: answer for uid, answer in self.state_answers.items() if uid in pod_uids}
        for uid in [uid for uid in self.state_probes if uid not in pod_uids]:
            self.state_probes.pop(uid).cancel()


class ModelMemories:
    """The memory of every model this process has reconciled, by (namespace, name)."""

    def __init__(self) -> None:
        self._by_model: dict[Key, ModelMemory] = {}

    def of(self, key: Key) -> ModelMemory:
        """The model's memory, new and empty the first time the model is seen (or after it was forgotten)."""
        memory = self._by_model.get(key)
        if memory is None:
            memory = self._by_model[key] = ModelMemory()
        return memory

    def forget(self, key: Key) -> None:
        """The model is gone. A pass still running for it keeps writing into its own, now detached, object; the
        reconfigure calls still running for it are stopped."""
        memory = self._by_model.pop(key, None)
        if memory is not None:
            memory.stop()

    def stop(self) -> None:
        for memory in self._by_model.values():
            memory.stop()

    def __contains__(self, key: object) -> bool:
        return key in self._by_model

    def __len__(self) -> int:
        return len(self._by_model)
