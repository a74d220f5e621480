"""The operator's part for one expert-parallel group of worker processes: epochs, failure detection, replacement.

`GroupConductor` forms the group (epoch e with every rank), then watches it as the operator would: it polls every
rank's `/state` (short timeout) and its process. A rank is failed when its process has exited, when it has not
answered `/state` for `unresponsive_after_s` (a frozen process: it is then killed, as an operator deletes its pod),
or when a member of the current epoch reports the group broken and names it. The survivors get the next epoch; a
replacement process is then started for each failed rank (unless `replace_failed` is off: `replace()` starts one on
request), and once it has loaded, every rank gets the epoch after.

The watch is level-based, as a reconciler: each round it compares the ranks it believes alive (`healthy`) with the
members of the last epoch sent, and sends a new epoch when they differ (or, after a refusal, again every
`retry_after_refusal_s`), so a second fault in the middle of a recovery is simply the next difference. Epochs are
sent one at a time; a member that dies while one is in flight is found by the next round. Every step is an event
with its monotonic time, for the recovery benchmark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from tidal.contract.control_api import (
    TOKEN_HEADER,
    ControlError,
    GroupHealth,
    GroupMember,
    GroupReconfigureRequest,
    GroupReconfigureResult,
    WorkerState,
)
from tidal.worker.testing.worker_processes import WorkerProcesses

log = logging.getLogger(__name__)


class EventKind(StrEnum):
    EPOCH_SENT = "epoch_sent"
    EPOCH_ANSWERED = "epoch_answered"  # one member applied it (or had already: a retry)
    EPOCH_REFUSED = "epoch_refused"  # one member refused it or could not be reached
    EPOCH_APPLIED = "epoch_applied"  # every member applied it
    FAULT_NOTICED = "fault_noticed"
    RANK_KILLED = "rank_killed"  # a failed rank whose process still ran (frozen, or named by a peer)
    REPLACEMENT_STARTED = "replacement_started"
    REPLACEMENT_LOADED = "replacement_loaded"
    REPLACEMENT_FAILED = "replacement_failed"
    WHOLE = "whole"  # an epoch with every rank was applied
    GROUP_LOST = "group_lost"  # no rank left alive


@dataclass(frozen=True)
class ConductorEvent:
    kind: EventKind
    at: float  # time.monotonic()
    rank: int | None = None
    epoch: int | None = None
    detail: str = ""


@dataclass
class EpochAttempt:
    """One epoch sent to its members, and what each answered."""

    epoch: int
    members: list[int]
    coordinator_rank: int
    sent_at: float
    answered_at: float | None = None
    results: dict[int, GroupReconfigureResult] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> "409 experts_unavailable: ..." or "unreachable"

    @property
    def applied(self) -> bool:
        return not self.refusals and sorted(self.results) == self.members


class GroupConductorError(RuntimeError):
    """The group could not be formed, or the watch gave up (no rank left, a replacement that died); the message
    ends with the tails of the workers' logs."""


class GroupConductor:
    def __init__(
        self,
        processes: WorkerProcesses,
        *,
        poll_interval_s: float = 0.05,
        state_timeout_s: float = 0.25,
        unresponsive_after_s: float = 1.0,
        reconfigure_timeout_s: float = 60.0,
        retry_after_refusal_s: float = 1.0,
        replace_failed: bool = True,
        load_timeout_s: float = 120.0,
        broken_grace_s: float = 3.0,
    ) -> None:
        self.processes = processes
        self.broken_grace_s = broken_grace_s
        self.poll_interval_s = poll_interval_s
        self.state_timeout_s = state_timeout_s
        self.unresponsive_after_s = unresponsive_after_s
        self.reconfigure_timeout_s = reconfigure_timeout_s
        self.retry_after_refusal_s = retry_after_refusal_s
        self.replace_failed = replace_failed
        self.load_timeout_s = load_timeout_s
        self.events: list[ConductorEvent] = []
        self.attempts: list[EpochAttempt] = []
        self.states: dict[int, WorkerState] = {}  # each rank's last /state answer
        self.healthy: set[int] = set()  # ranks believed alive and loaded: the members the group should have
        self.joining: dict[int, float] = {}  # rank -> when its replacement started (loading)
        self.error: str | None = None
        self._epoch = 0
        self._miss_since: dict[int, float] = {}
        self._client = httpx.AsyncClient(headers={TOKEN_HEADER: f"Bearer {processes.launch.token}"})
        self._watch: asyncio.Task[None] | None = None

    # ----- context -----
    async def __aenter__(self) -> GroupConductor:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await self._client.aclose()

    # ----- queries -----
    @property
    def epoch(self) -> int:
        """The last epoch sent."""
        return self._epoch

    @property
    def applied(self) -> EpochAttempt | None:
        """The last epoch every member applied."""
        return next((a for a in reversed(self.attempts) if a.applied), None)

    def attempt(self, epoch: int) -> EpochAttempt:
        return next(a for a in self.attempts if a.epoch == epoch)

    def find(self, kind: EventKind, *, after: float | None = None, rank: int | None = None) -> ConductorEvent | None:
        """The first event of `kind` (for `rank`, when given) later than `after`."""
        return next(
            (
                e
                for e in self.events
                if e.kind is kind and (after is None or e.at > after) and (rank is None or e.rank == rank)
            ),
            None,
        )

    # ----- forming and watching -----
    async def form(self, ranks: list[int] | None = None) -> EpochAttempt:
        """Send the next epoch with `ranks` (default: all of the group's current size) and wait for every answer;
        GroupConductorError when a member refuses it."""
        members = sorted(self.processes.ranks if ranks is None else ranks)
        attempt = await self.send_epoch(members)
        problems = [f"rank {r}: {why}" for r, why in sorted(attempt.refusals.items())]
        problems += [
            f"rank {r} answered with group_epoch {result.state.group_epoch}"
            for r, result in sorted(attempt.results.items())
            if result.state.group_epoch != attempt.epoch
        ]
        if problems:
            raise GroupConductorError(
                f"epoch {attempt.epoch} with members {members} was not applied: {'; '.join(problems)}\n"
                f"{self.processes.log_reports()}"
            )
        self.healthy = set(members)
        return attempt

    def start_watching(self) -> None:
        if self._watch is not None:
            raise RuntimeError("the conductor is watching already")
        self._watch = asyncio.create_task(self._watch_loop(), name="group-conductor")

    def replace(self, rank: int) -> None:
        """Start a replacement process for `rank` (whose process must be gone); the watch admits it once loaded."""
        process = self.processes.start(rank)
        self.states.pop(rank, None)  # the last answer of the process it replaces
        self._miss_since.pop(rank, None)  # its polls fail until it listens; only a member's misses count
        self.joining[rank] = process.started_at
        self._record(EventKind.REPLACEMENT_STARTED, rank=rank, detail=f"pid {process.popen.pid}")

    async def wait_for(
        self, kind: EventKind, *, after: float | None = None, rank: int | None = None, timeout_s: float = 60.0
    ) -> ConductorEvent:
        """The first event of `kind` later than `after`, once it happens; GroupConductorError when the watch gave up
        or the time runs out (with every worker's log tail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.find(kind, after=after, rank=rank)
            if event is not None:
                return event
            if self.error is not None:
                raise GroupConductorError(f"waiting for {kind}: the conductor stopped: {self.error}")
            if time.monotonic() > deadline:
                raise GroupConductorError(
                    f"no {kind} event{'' if rank is None else f' for rank {rank}'} within {timeout_s:g}s; events:\n"
                    f"{self.timeline()}\n{self.processes.log_reports(lines=20)}"
                )
            await asyncio.sleep(0.02)

    async def wait_whole(self, *, after: float | None = None, timeout_s: float = 120.0) -> EpochAttempt:
        """The epoch with every rank applied after `after`."""
        event = await self.wait_for(EventKind.WHOLE, after=after, timeout_s=timeout_s)
        assert event.epoch is not None
        return self.attempt(event.epoch)

    def timeline(self, since: float | None = None) -> str:
        """Events one per line, in seconds after `since` (default: the first event)."""
        origin = since if since is not None else (self.events[0].at if self.events else 0.0)
        lines = []
        for e in self.events:
            who = "" if e.rank is None else f" rank {e.rank}"
            epoch = "" if e.epoch is None else f" epoch {e.epoch}"
            lines.append(f"{e.at - origin:+8.3f}s {e.kind}{who}{epoch} {e.detail}".rstrip())
        return "\n".join(lines)

    # ----- the watch -----
    async def _watch_loop(self) -> None:
        try:
            while self.error is None:
                started = time.monotonic()
                await self._reconcile()
                await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))
        except Exception as exc:  # a bug in the conductor: stop, and make every wait say why
            log.exception("the group conductor failed")
            self.error = f"{type(exc).__name__}: {exc}"

    async def _reconcile(self) -> None:
        await self._poll(sorted(self.healthy | set(self.joining)))
        failed = self._failed_ranks()
        for rank, why in sorted(failed.items()):
            self._remove_failed(rank, why)
        self._admit_loaded_replacements()
        if self.error is not None:
            return
        if not self.healthy:
            self.error = "no rank of the group is left alive"
            self._record(EventKind.GROUP_LOST)
            return
        last = self.attempts[-1] if self.attempts else None
        target = sorted(self.healthy)
        retry_due = (
            last is not None
            and not last.applied
            and last.answered_at is not None
            and time.monotonic() - last.answered_at >= self.retry_after_refusal_s
        )
        if last is None or target != last.members or retry_due or self._broken_without_culprit(last):
            last = await self.send_epoch(target)
        if self.replace_failed:
            # After the survivors' epoch was sent (without the rank), as the survivors must not wait on a load.
            for rank in self.processes.ranks:
                is_gone = rank not in self.healthy and rank not in self.joining
                if is_gone and rank not in last.members and not self.processes[rank].is_running:
                    self.replace(rank)

    async def _poll(self, ranks: list[int]) -> None:
        async def one(rank: int) -> None:
            sent_at = time.monotonic()
            try:
                url = f"{self.processes[rank].control_url}/state"
                response = await self._client.get(url, timeout=self.state_timeout_s)
                response.raise_for_status()
                self.states[rank] = WorkerState.model_validate(response.json())
                self._miss_since.pop(rank, None)
            except (httpx.HTTPError, ValueError):
                self._miss_since.setdefault(rank, sent_at)

        await asyncio.gather(*(one(rank) for rank in ranks))

    def _failed_ranks(self) -> dict[int, str]:
        now = time.monotonic()
        failed: dict[int, str] = {}
        for rank in sorted(self.healthy):
            process = self.processes[rank]
            missing_for = now - self._miss_since.get(rank, now)
            if not process.is_running:
                failed[rank] = f"process exited with code {process.exit_code}"
            elif missing_for >= self.unresponsive_after_s:
                failed[rank] = f"no /state answer for {missing_for:.2f}s"
        current = self.attempts[-1].epoch if self.attempts else 0
        for rank in sorted(self.healthy - failed.keys()):
            state = self.states.get(rank)
            if state is None or state.group_epoch != current or state.group.health is not GroupHealth.BROKEN:
                continue  # only a report about the current epoch counts; an older one was handled already
            peer = state.group.broken_peer_rank
            if peer is not None and peer in self.healthy and peer not in failed:
                failed[peer] = f"rank {rank} reports the group broken by it: {state.group.broken_reason}"
        return failed

    def _broken_without_culprit(self, last: EpochAttempt) -> bool:
        """A member reports the applied epoch broken and, well past the time its probe needs (`broken_grace_s`), names
        no peer: a collective missed its deadline with every rank alive (a slow step). The same members get a new
        epoch. (Sooner, a frozen peer not named yet would be sent the epoch too, and its rendezvous would hang.)"""
        reports = [
            s for r in last.members if (s := self.states.get(r)) is not None
            and s.group_epoch == last.epoch and s.group.health is GroupHealth.BROKEN
        ]  # fmt: skip
        if not last.applied or not reports or any(s.group.broken_peer_rank is not None for s in reports):
            return False
        if max(s.group.broken_for_s or 0.0 for s in reports) < self.broken_grace_s:
            return False
        self._record(EventKind.FAULT_NOTICED, epoch=last.epoch, detail=f"broken with no culprit: "
                     f"{reports[0].group.broken_reason}; the same members get the next epoch")  # fmt: skip
        return True

    def _remove_failed(self, rank: int, why: str) -> None:
        self._record(EventKind.FAULT_NOTICED, rank=rank, detail=why)
        self.healthy.discard(rank)
        self._miss_since.pop(rank, None)
        if self.processes[rank].is_running:
            self.processes.kill(rank)
            self._record(EventKind.RANK_KILLED, rank=rank)

    def _admit_loaded_replacements(self) -> None:
        now = time.monotonic()
        for rank, started_at in sorted(self.joining.items()):
            process = self.processes[rank]
            state = self.states.get(rank)
            if not process.is_running:
                del self.joining[rank]
                self._record(EventKind.REPLACEMENT_FAILED, rank=rank, detail=f"exited with {process.exit_code}")
                self.error = f"the replacement of rank {rank} exited while loading\n{process.log_report()}"
            elif state is not None and state.model_loaded:
                del self.joining[rank]
                self._miss_since.pop(rank, None)
                self.healthy.add(rank)
                self._record(EventKind.REPLACEMENT_LOADED, rank=rank, detail=f"{now - started_at:.2f}s after start")
            elif now - started_at > self.load_timeout_s:
                del self.joining[rank]
                self._record(EventKind.REPLACEMENT_FAILED, rank=rank, detail="not loaded in time")
                self.error = (
                    f"the replacement of rank {rank} did not load within {self.load_timeout_s:g}s\n"
                    f"{process.log_report()}"
                )

    async def send_epoch(self, members: list[int], group_size: int | None = None) -> EpochAttempt:
        """Send the next epoch with `members` to each of them and wait for every answer (applied or refused).
        `group_size`: the epoch's (default: the processes' current size, which a resize sets)."""
        seen = max((s.group_epoch for s in self.states.values()), default=0)
        self._epoch = max(self._epoch, seen) + 1
        previous = self.applied
        stayed = [r for r in members if previous is not None and r in previous.members]
        coordinator = min(stayed or members)
        request = GroupReconfigureRequest(
            epoch=self._epoch,
            members=[GroupMember(rank=r, address=self.processes[r].group_address) for r in members],
            coordinator_rank=coordinator,
            group_size=self.processes.group_size if group_size is None else group_size,
            timeout_s=self.reconfigure_timeout_s,
        )
        attempt = EpochAttempt(self._epoch, members, coordinator, sent_at=time.monotonic())
        self.attempts.append(attempt)
        self._record(EventKind.EPOCH_SENT, epoch=attempt.epoch, detail=f"members {members}, coordinator {coordinator}")
        await asyncio.gather(*(self._reconfigure(rank, request, attempt) for rank in members))
        attempt.answered_at = time.monotonic()
        if attempt.applied:
            self._record(EventKind.EPOCH_APPLIED, epoch=attempt.epoch, detail=f"members {members}")
            if members == self.processes.ranks:
                self._record(EventKind.WHOLE, epoch=attempt.epoch)
        return attempt

    async def _reconfigure(self, rank: int, request: GroupReconfigureRequest, attempt: EpochAttempt) -> None:
        url = f"{self.processes[rank].control_url}/group/reconfigure"
        body = request.model_dump(mode="json", exclude_none=True)
        try:
            response = await self._client.post(url, json=body, timeout=self.reconfigure_timeout_s + 10.0)
        except httpx.HTTPError as exc:
            attempt.refusals[rank] = f"unreachable: {type(exc).__name__}: {exc}"
            self._record(EventKind.EPOCH_REFUSED, rank=rank, epoch=attempt.epoch, detail=attempt.refusals[rank])
            return
        if response.status_code == 200:
            result = GroupReconfigureResult.model_validate(response.json())
            attempt.results[rank] = result
            self.states[rank] = result.state
            detail = f"applied={result.applied} in {result.duration_s:.3f}s"
            if result.loaded_experts:
                detail += f", loaded experts {result.loaded_experts}"
            self._record(EventKind.EPOCH_ANSWERED, rank=rank, epoch=attempt.epoch, detail=detail)
            return
        try:
            error = ControlError.model_validate(response.json())
            why = f"{response.status_code} {error.code}: {error.message}"
        except ValueError:
            why = f"{response.status_code}: {response.text[:300]}"
        attempt.refusals[rank] = why
        self._record(EventKind.EPOCH_REFUSED, rank=rank, epoch=attempt.epoch, detail=why)

    def _record(self, kind: EventKind, *, rank: int | None = None, epoch: int | None = None, detail: str = "") -> None:
        event = ConductorEvent(kind, time.monotonic(), rank, epoch, detail)
        self.events.append(event)
        log.info("%s%s%s %s", kind, "" if rank is None else f" rank {rank}", "" if epoch is None else f" epoch {epoch}",
                 detail)  # fmt: skip
