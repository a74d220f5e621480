"""The operator's side of every rank's control API: read states for a pass, carry out sleep/wake/weight actions.

The fleet holds no per-model state: what it learns that is worth keeping between passes (checksums, refused weight
updates) goes into the model's `ModelMemory`, which the caller passes in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import PurePosixPath

import httpx
from pydantic import SecretStr

from tidal.contract.control_api import GroupHealth, GroupMember, GroupReconfigureRequest, WorkerState
from tidal.contract.error_codes import ErrorCode
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.actions import EpochMemberRef, ReconfigureGroup, SleepRank, UpdateWeights, WakeRank
from tidal.operator.planner.observed import EpochRefusal, RankObservation, UpdateFailure
from tidal.operator.runtime.memory import EpochFlight, ModelMemory, Silence, StateAnswer, StateProbe, wall_clock
from tidal.operator.runtime.queue import Key
from tidal.operator.workerclient import STATE_TIMEOUT_S, CallErrorCode, WorkerCallError, WorkerClient

log = logging.getLogger("tidal.operator.workers")

# How long a pass waits for the /state of a rank whose previous /state went unanswered (see `_read_state`).
SUSPECT_STATE_TIMEOUT_S = 0.05

# Failures that say "not now" rather than "this checkpoint is wrong": the worker's refusals of the moment, and the
# client's own codes for a call that got no readable answer.
TRANSIENT_CODES: frozenset[ErrorCode | CallErrorCode] = frozenset(
    {
        ErrorCode.BUSY,
        ErrorCode.NOT_LOADED,
        ErrorCode.DRAIN_TIMEOUT,
        ErrorCode.WEIGHTS_UNAVAILABLE,
        CallErrorCode.UNREACHABLE,
        CallErrorCode.BAD_RESPONSE,
    }
)


@dataclass(frozen=True)
class Target:
    """Where one rank's control API is, and which process it is (the pod UID changes when the pod is replaced).
    `port`: the control port the pod was started with (None: not known, the spec's is used). After a change of
    spec.serving.controlPort the pods not yet replaced still listen on the old one."""

    address: str
    uid: str
    port: int | None = None


class WorkerCall(StrEnum):
    """The control-API calls the fleet makes (named by their routes): for actions, and the checksum it reads."""

    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    WEIGHTS_UPDATE = "weights/update"
    GROUP_RECONFIGURE = "group/reconfigure"
    WEIGHTS_CHECKSUM = "weights/checksum"


@dataclass(frozen=True)
class CallFailure:
    pod: str
    call: WorkerCall
    message: str
    code: ErrorCode | CallErrorCode = CallErrorCode.UNREACHABLE

    @property
    def transient(self) -> bool:
        return self.code in TRANSIENT_CODES


def _start_probe(client: WorkerClient, timeout_s: float, name: str) -> StateProbe:
    async def read() -> tuple[WorkerState, float]:
        state = await client.state(timeout=timeout_s)
        return state, time.monotonic()

    probe = asyncio.get_running_loop().create_task(read(), name=name)
    probe.add_done_callback(_retrieve)
    return probe


def _retrieve(probe: StateProbe) -> None:
    """A probe's failure is read here, whether or not a pass reads it later: one dropped unread and not cancelled (in
    the detached memory of a model forgotten while its pass ran) must not log "Task exception was never retrieved"."""
    if not probe.cancelled():
        probe.exception()


class WorkerFleet:
    def __init__(self, http: httpx.AsyncClient, metrics: OperatorMetrics) -> None:
        self._http = http
        self._metrics = metrics
        # Every call's error series exists from the start at 0, so a dashboard shows "no failures" rather than no
        # data, and a rate over it is defined before the first failure.
        for call in WorkerCall:
            metrics.worker_call_errors.labels(call)

    def _client(self, target: Target, port: int, token: SecretStr) -> WorkerClient:
        return WorkerClient(self._http, target.address, target.port if target.port is not None else port, token)

    @staticmethod
    async def _read_state(
        memory: ModelMemory, uid: str, client: WorkerClient, timeout_s: float, asked: float
    ) -> WorkerState:
        """The rank's `/state` for this pass, or its `WorkerCallError`.

        A rank that missed its last /state is suspect (frozen, or gone): its call must not hold the pass that may send
        its survivors their epoch. But a rank that stalled once and now answers in a few hundred milliseconds (loading,
        GIL contention) must get its answers counted, or its silence grows until it is failed and its pod deleted. So
        the suspect's call runs on its own with the whole timeout (a probe, kept in the memory from one pass to the
        next), and each pass waits for it only SUSPECT_STATE_TIMEOUT_S: unfinished, it is a miss (the probe goes on);
        finished, its answer or error is this pass's read.

        An answer taken a pass late came after the previous pass stopped waiting for it, so it went into no earlier
        decision; but the next pass may come much later (resyncSeconds, when nothing was done). It is used only if it
        is no older than a direct read's answer may be (`timeout_s`); an older one still shows the rank answers: it is
        no longer suspect and is asked again, with the whole timeout, like any rank whose last /state was answered."""
        probe = memory.state_probes.get(uid)
        if probe is None:
            if uid not in memory.state_misses:
                return await client.state(timeout=timeout_s)
            probe = memory.state_probes[uid] = _start_probe(client, timeout_s, f"state-{uid}")
        wait = min(timeout_s, SUSPECT_STATE_TIMEOUT_S)
        done, _ = await asyncio.wait({probe}, timeout=wait)
        if not done:
            raise WorkerCallError(CallErrorCode.UNREACHABLE, f"GET /state: no answer in {wait:g} s yet (still asked)")
        if memory.state_probes.get(uid) is probe:
            del memory.state_probes[uid]
        if probe.cancelled():  # the model was forgotten meanwhile (`ModelMemory.stop`)
            raise WorkerCallError(CallErrorCode.UNREACHABLE, "GET /state: call stopped")
        state, answered = probe.result()  # raises the probe's WorkerCallError
        if asked - answered <= timeout_s:
            return state
        memory.state_misses.pop(uid, None)
        return await client.state(timeout=timeout_s)

    async def observe(
        self,
        key: Key,
        memory: ModelMemory,
        targets: dict[str, Target],
        port: int,
        token: SecretStr | None,
        state_timeout_s: float = STATE_TIMEOUT_S,
    ) -> dict[str, RankObservation]:
        """`GET /state` (and the checksum when not known yet) of every reachable rank, in parallel. A rank that does
        not answer is told with how long it has been silent (from the first miss in a row, per process), how many
        calls in a row it missed, and its last answer."""
        failures = memory.update_failures
        memory.keep_checksums_of({t.uid for t in targets.values()})
        checksums = memory.checksums
        if token is None:
            return {pod: RankObservation(update_failure=failures.get(pod)) for pod in targets}

        async def one(pod: str, target: Target) -> tuple[str, RankObservation]:
            client = self._client(target, port, token)
            asked = time.monotonic()
            # A live rank answers in milliseconds; a miss only extends its silence, and failing takes the whole
            # deadline of misses in a row.
            try:
                state = await self._read_state(memory, target.uid, client, state_timeout_s, asked)
            except WorkerCallError as exc:
                log.debug("%s/%s: state of %s: %s", *key, pod, exc)
                rejected = exc.code == ErrorCode.UNAUTHORIZED
                silence = memory.state_misses.get(target.uid)
                if silence is None:
                    silence = memory.state_misses[target.uid] = Silence(since=asked)
                else:
                    silence.misses += 1
                last = memory.state_answers.get(target.uid)
                missed = RankObservation(
                    update_failure=failures.get(pod),
                    token_rejected=rejected,
                    silent_for_s=time.monotonic() - silence.since,
                    missed_reads=silence.misses,
                    last_state=last.state if last is not None else None,
                    last_checksum=last.checksum if last is not None else None,
                )
                return pod, missed
            memory.state_misses.pop(target.uid, None)
            checksum = None
            # A rank of a group that does not serve yet is not hashed: the experts it holds change with its epoch,
            # and a long hash must not hold up the pass that sends that epoch.
            hashable = state.group.health in (GroupHealth.SOLO, GroupHealth.SERVING)
            if state.model_loaded and state.weights_version is not None and hashable:
                cache_key = (target.uid, state.weights_version, state.weights_source)
                checksum = checksums.get(cache_key)
                if checksum is None:
                    try:
                        checksum = (await client.checksum()).overall
                        checksums[cache_key] = checksum
                    except WorkerCallError as exc:
                        self._metrics.worker_call_errors.labels(WorkerCall.WEIGHTS_CHECKSUM).inc()
                        log.warning("%s/%s: checksum of %s: %s", *key, pod, exc)
            memory.state_answers[target.uid] = StateAnswer(state, checksum)
            return pod, RankObservation(state=state, checksum=checksum, update_failure=failures.get(pod))

        pairs = await asyncio.gather(*(one(pod, target) for pod, target in targets.items()))
        return dict(pairs)

    async def transition(
        self, actions: list[SleepRank] | list[WakeRank], targets: dict[str, Target], port: int, token: SecretStr
    ) -> list[CallFailure | None]:
        """Sleep or wake every rank named, all at once; returns each call's failure (None: done), in their order."""
        if not actions:
            return []
        started = time.monotonic()

        async def one(action: SleepRank | WakeRank) -> CallFailure | None:
            target = targets.get(action.pod)
            call = WorkerCall.SLEEP if isinstance(action, SleepRank) else WorkerCall.WAKE_UP
            if target is None:
                return CallFailure(action.pod, call, "the pod has no address")
            client = self._client(target, port, token)
            try:
                if isinstance(action, SleepRank):
                    await client.sleep(action.level)
                else:
                    await client.wake_up()
            except WorkerCallError as exc:
                self._metrics.worker_call_errors.labels(call).inc()
                return CallFailure(action.pod, call, exc.message, exc.code)
            return None

        results = await asyncio.gather(*(one(a) for a in actions))
        kind = "sleep" if isinstance(actions[0], SleepRank) else "wake"
        self._metrics.transition_seconds.labels(kind).observe(time.monotonic() - started)
        return results

    async def update_weights(
        self, memory: ModelMemory, actions: list[UpdateWeights], targets: dict[str, Target], port: int, token: SecretStr
    ) -> list[CallFailure | None]:
        """Every rank named gets its update concurrently; the pass waits for all of them. Returns each call's failure
        (None: done), in their order."""

        async def one(action: UpdateWeights) -> CallFailure | None:
            target = targets.get(action.pod)
            if target is None:
                return CallFailure(action.pod, WorkerCall.WEIGHTS_UPDATE, "the pod has no address")
            try:
                result = await self._client(target, port, token).update_weights(action.source, action.version)
            except WorkerCallError as exc:
                self._metrics.worker_call_errors.labels(WorkerCall.WEIGHTS_UPDATE).inc()
                # Only a refusal of the checkpoint itself stops the roll. A rank that is unreachable (it may have
                # died mid-call; its replacement starts on the new weights), busy (still applying an update that a
                # previous operator process asked for), not loaded, asleep or draining is asked again next pass.
                if exc.code not in TRANSIENT_CODES:
                    message = f"{exc.code}: {exc.message}"
                    failure = UpdateFailure(version=action.version, message=message, source=action.source)
                    memory.update_failures[action.pod] = failure
                return CallFailure(action.pod, WorkerCall.WEIGHTS_UPDATE, exc.message, exc.code)
            # Keyed as `/state` reports the source: the directory as the worker holds it (a Path's spelling).
            memory.checksums[(target.uid, result.version, str(PurePosixPath(action.source)))] = result.checksum
            memory.update_failures.pop(action.pod, None)
            return None

        return list(await asyncio.gather(*(one(a) for a in actions)))

    def start_epoch(
        self,
        memory: ModelMemory,
        action: ReconfigureGroup,
        targets: dict[str, Target],
        port: int,
        token: SecretStr,
        report: Callable[[EpochFlight], Awaitable[None]],
    ) -> EpochFlight:
        """Send the epoch to every member at once, each call on its own (its own timeout: a slow rank holds no other
        member's call), in the background: the pass goes on, and each answer goes into the model's memory as it comes.
        `report` runs once every member answered."""
        request = GroupReconfigureRequest(
            epoch=action.epoch,
            members=[GroupMember(rank=m.rank, address=m.address) for m in action.members],
            coordinator_rank=action.coordinator_rank,
            group_size=action.group_size,
            timeout_s=action.timeout_s,
        )
        flight = EpochFlight(
            epoch=action.epoch,
            members=[m.rank for m in action.members],
            coordinator_rank=action.coordinator_rank,
            sent_at=time.monotonic(),
            sent_wall=wall_clock(),
        )

        async def one(member: EpochMemberRef) -> None:
            target = targets.get(member.pod)
            if target is None:
                no_address = "the pod has no address"
                flight.record(
                    member.rank, EpochRefusal(rank=member.rank, code=CallErrorCode.UNREACHABLE, message=no_address)
                )
                return
            try:
                result = await self._client(target, port, token).reconfigure(request)
            except WorkerCallError as exc:
                self._metrics.worker_call_errors.labels(WorkerCall.GROUP_RECONFIGURE).inc()
                flight.record(member.rank, EpochRefusal(rank=member.rank, code=exc.code, message=exc.message))
                return
            flight.record(member.rank, result)

        async def send() -> None:
            await asyncio.gather(*(one(m) for m in action.members))
            await report(flight)

        memory.start_epoch(action.replica, flight)
        flight.task = asyncio.get_running_loop().create_task(send(), name=f"epoch-{action.replica}-{action.epoch}")
        return flight
