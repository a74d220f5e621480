"""The operator's side of every rank's control API: read states for a pass, carry out sleep/wake/weight actions.

The fleet holds no per-model state: what it learns that is worth keeping between passes (checksums, refused weight
updates) goes into the model's `ModelMemory`, which the caller passes in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import StrEnum

import httpx
from pydantic import SecretStr

from tidal.contract.error_codes import ErrorCode
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.actions import SleepRank, UpdateWeights, WakeRank
from tidal.operator.planner.observed import RankObservation, UpdateFailure
from tidal.operator.runtime.memory import ModelMemory
from tidal.operator.runtime.queue import Key
from tidal.operator.workerclient import CallErrorCode, WorkerCallError, WorkerClient

log = logging.getLogger("tidal.operator.workers")

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
    """Where one rank's control API is, and which process it is (the pod UID changes when the pod is replaced)."""

    address: str
    uid: str


class WorkerCall(StrEnum):
    """The control-API calls the fleet makes for actions (named by their routes)."""

    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    WEIGHTS_UPDATE = "weights/update"


@dataclass(frozen=True)
class CallFailure:
    pod: str
    call: WorkerCall
    message: str
    code: ErrorCode | CallErrorCode = CallErrorCode.UNREACHABLE

    @property
    def transient(self) -> bool:
        return self.code in TRANSIENT_CODES


class WorkerFleet:
    def __init__(self, http: httpx.AsyncClient, metrics: OperatorMetrics) -> None:
        self._http = http
        self._metrics = metrics

    def _client(self, target: Target, port: int, token: SecretStr) -> WorkerClient:
        return WorkerClient(self._http, target.address, port, token)

    async def observe(
        self, key: Key, memory: ModelMemory, targets: dict[str, Target], port: int, token: SecretStr | None
    ) -> dict[str, RankObservation]:
        """`GET /state` (and the checksum when not known yet) of every reachable rank, in parallel."""
        failures = memory.update_failures
        memory.keep_checksums_of({t.uid for t in targets.values()})
        checksums = memory.checksums
        if token is None:
            return {pod: RankObservation(update_failure=failures.get(pod)) for pod in targets}

        async def one(pod: str, target: Target) -> tuple[str, RankObservation]:
            client = self._client(target, port, token)
            try:
                state = await client.state()
            except WorkerCallError as exc:
                log.debug("%s/%s: state of %s: %s", *key, pod, exc)
                rejected = exc.code == ErrorCode.UNAUTHORIZED
                return pod, RankObservation(update_failure=failures.get(pod), token_rejected=rejected)
            checksum = None
            if state.model_loaded and state.weights_version is not None:
                cache_key = (target.uid, state.weights_version)
                checksum = checksums.get(cache_key)
                if checksum is None:
                    try:
                        checksum = (await client.checksum()).overall
                        checksums[cache_key] = checksum
                    except WorkerCallError as exc:
                        self._metrics.worker_call_errors.labels("checksum").inc()
                        log.warning("%s/%s: checksum of %s: %s", *key, pod, exc)
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
                self._metrics.worker_call_errors.labels("weights_update").inc()
                # Only a refusal of the checkpoint itself stops the roll. A rank that is unreachable (it may have
                # died mid-call; its replacement starts on the new weights), busy (still applying an update that a
                # previous operator process asked for), not loaded, asleep or draining is asked again next pass.
                if exc.code not in TRANSIENT_CODES:
                    message = f"{exc.code}: {exc.message}"
                    memory.update_failures[action.pod] = UpdateFailure(version=action.version, message=message)
                return CallFailure(action.pod, WorkerCall.WEIGHTS_UPDATE, exc.message, exc.code)
            memory.checksums[(target.uid, result.version)] = result.checksum
            memory.update_failures.pop(action.pod, None)
            return None

        return list(await asyncio.gather(*(one(a) for a in actions)))
