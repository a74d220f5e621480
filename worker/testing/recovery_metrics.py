"""What a fault cost a group: read from the conductor's events and the load's per-chunk times (pure, no I/O).

All times are time.monotonic() of the harness process. The fault is the moment the harness sent the signal. The
survivors' epoch is the first epoch applied after the fault without the failed ranks; "serving again" is the first
chunk of a surviving stream after that epoch was answered. A surviving stream's interruption is its longest gap
between two chunks: the fault's interruption over the gaps that end after the fault and start before the epoch that
brings the group back whole was sent, the rejoin's over those that end after that. A survivor's request is lost when
it did not complete or its text is not the reference's; a failed rank's request is expected to end with a
connection error, and those are counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tidal.worker.testing.group_conductor import ConductorEvent, EpochAttempt, EventKind, GroupConductor
from tidal.worker.testing.streaming_load import StreamRecord


@dataclass
class StreamCounts:
    total: int = 0
    completed: int = 0
    connection_errors: int = 0
    other_failures: int = 0
    wrong_output: int = 0  # completed, but not the reference text

    @property
    def lost(self) -> int:
        """Requests that did not give their reference output, whatever the reason."""
        return self.total - self.completed + self.wrong_output


@dataclass
class RecoveryReport:
    fault: str
    failed_ranks: list[int]
    detection_s: float | None  # fault -> the conductor noticed it
    survivors_epoch: int | None
    survivors_reconfigure_s: float | None  # survivors' epoch sent -> every survivor answered
    fault_to_serving_s: float | None  # fault -> first chunk of a surviving stream after the survivors' epoch
    interruption_s: float | None  # longest gap of a surviving stream from the fault until the rejoin's epoch is sent
    rejoin_interruption_s: float | None  # longest gap of a surviving stream after the rejoin's epoch was sent
    replacement_load_s: float | None  # replacement started -> loaded
    whole_after_replacement_s: float | None  # replacement started -> the epoch with every rank applied
    whole_epoch: int | None
    expert_reload_s: float | None  # the survivors' longest expert reload in their epoch (their /state)
    reconfigure_duration_s: float | None  # the survivors' longest reconfigure (their answers' duration_s)
    rejoin_duration_s: float | None  # the longest reconfigure of the whole group's epoch
    degraded_experts: list[int]
    survivors: StreamCounts
    failed_rank: StreamCounts
    timeline: list[dict[str, object]] = field(default_factory=list)

    @property
    def lost_on_survivors(self) -> int:
        return self.survivors.lost

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["lost_on_survivors"] = self.survivors.lost
        data["lost_on_failed_rank"] = self.failed_rank.lost
        return data

    def summary(self) -> str:
        def s(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f} s"

        degraded = f", degraded experts {self.degraded_experts}" if self.degraded_experts else ""
        rows = (
            ("detected after", s(self.detection_s)),
            ("survivors' epoch applied in", f"{s(self.survivors_reconfigure_s)} (epoch {self.survivors_epoch})"),
            ("survivors' serving interruption", s(self.interruption_s)),
            ("fault -> serving again", s(self.fault_to_serving_s)),
            ("replacement loaded after", s(self.replacement_load_s)),
            ("whole again after replacement start", f"{s(self.whole_after_replacement_s)} (epoch {self.whole_epoch})"),
            ("interruption at the rejoin", s(self.rejoin_interruption_s)),
            ("expert reload (survivors)", s(self.expert_reload_s) + degraded),
            ("reconfigure", f"survivors {s(self.reconfigure_duration_s)}, rejoin {s(self.rejoin_duration_s)}"),
            (
                "requests lost on survivors",
                f"{self.survivors.lost} of {self.survivors.total} ({self.survivors.wrong_output} with a wrong output)",
            ),
            (
                "requests lost on the failed rank(s)",
                f"{self.failed_rank.connection_errors} connection errors, {self.failed_rank.other_failures} other "
                f"failures, {self.failed_rank.completed} completed of {self.failed_rank.total}",
            ),
        )
        lines = [f"fault: {self.fault} of ranks {self.failed_ranks}"]
        lines += [f"{label + ':':<37}{value}" for label, value in rows]
        return "\n".join(lines)


def count_streams(records: Sequence[StreamRecord], reference: Sequence[str] | None) -> StreamCounts:
    counts = StreamCounts(total=len(records))
    for record in records:
        if record.completed:
            counts.completed += 1
            if reference is not None and record.text != reference[record.request.index]:
                counts.wrong_output += 1
        elif record.lost_connection:
            counts.connection_errors += 1
        else:
            counts.other_failures += 1
    return counts


def survivors_epoch(conductor: GroupConductor, fault_at: float, failed_ranks: Sequence[int]) -> EpochAttempt | None:
    return next(
        (
            a
            for a in conductor.attempts
            if a.sent_at > fault_at and a.applied and not set(failed_ranks) & set(a.members)
        ),
        None,
    )


def recovery_report(
    fault: str,
    fault_at: float,
    failed_ranks: Sequence[int],
    conductor: GroupConductor,
    records: Sequence[StreamRecord],
    reference: Sequence[str] | None = None,
) -> RecoveryReport:
    failed = set(failed_ranks)
    survivors = [r for r in records if r.request.rank not in failed]
    on_failed = [r for r in records if r.request.rank in failed]
    noticed = conductor.find(EventKind.FAULT_NOTICED, after=fault_at)
    epoch = survivors_epoch(conductor, fault_at, failed_ranks)
    started = conductor.find(EventKind.REPLACEMENT_STARTED, after=fault_at)
    loaded = conductor.find(EventKind.REPLACEMENT_LOADED, after=fault_at)
    whole = conductor.find(EventKind.WHOLE, after=fault_at)
    replacement_at = started.at if started is not None else None
    whole_attempt = conductor.attempt(whole.epoch) if whole is not None and whole.epoch is not None else None
    # The fault's window ends when the epoch that brings the group back whole is sent; the rejoin's begins there.
    rejoin_at = whole_attempt.sent_at if whole_attempt is not None else None

    serving_again = None
    if epoch is not None and epoch.answered_at is not None:
        answered_at = epoch.answered_at
        firsts = [t for t in (r.first_chunk_after(answered_at) for r in survivors) if t is not None]
        serving_again = min(firsts, default=None)

    def worst_gap(after: float | None, before: float | None) -> float | None:
        if after is None:
            return None
        gaps = [g for g in (r.longest_gap(after, before) for r in survivors) if g is not None]
        return max(gaps, default=None)

    survivor_results = list(epoch.results.values()) if epoch is not None else []
    reloads = [r.state.group.expert_reload_s for r in survivor_results if r.state.group.expert_reload_s is not None]
    return RecoveryReport(
        fault=fault,
        failed_ranks=sorted(failed),
        detection_s=_since(fault_at, noticed.at if noticed else None),
        survivors_epoch=epoch.epoch if epoch is not None else None,
        survivors_reconfigure_s=_since(epoch.sent_at, epoch.answered_at) if epoch is not None else None,
        fault_to_serving_s=_since(fault_at, serving_again),
        interruption_s=worst_gap(fault_at, rejoin_at),
        rejoin_interruption_s=worst_gap(rejoin_at, None),
        replacement_load_s=_since(replacement_at, loaded.at if loaded else None),
        whole_after_replacement_s=_since(replacement_at, whole.at if whole else None),
        whole_epoch=whole.epoch if whole is not None else None,
        expert_reload_s=max(reloads, default=None),
        reconfigure_duration_s=max((r.duration_s for r in survivor_results), default=None),
        rejoin_duration_s=max((r.duration_s for r in whole_attempt.results.values()), default=None)
        if whole_attempt is not None
        else None,
        degraded_experts=sorted({e for r in survivor_results for e in r.state.group.degraded_experts}),
        survivors=count_streams(survivors, reference),
        failed_rank=count_streams(on_failed, reference),
        timeline=[_event_json(e, fault_at) for e in conductor.events],
    )


def _event_json(event: ConductorEvent, origin: float) -> dict[str, object]:
    return {
        "t_s": round(event.at - origin, 4),
        "kind": str(event.kind),
        "rank": event.rank,
        "epoch": event.epoch,
        "detail": event.detail,
    }


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
