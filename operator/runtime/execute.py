"""Carry out a plan's actions in phases: group epochs, Kubernetes objects, the status and Events, the workers' calls.

- Group epochs (`/group/reconfigure` to every member) are started first and not waited for: a group's survivors
  wait for theirs, and the pass must stay free to see the next failure. Each answer lands in the model's memory; once
  every member answered, a refusal is posted as a Warning Event and the model is queued for a pass at once.
- Children (Secret, Services, NetworkPolicy) one after another in the plan's order, then pods all at once: a pod
  mounts the token Secret, so the Secret exists first.
- The status and Events. They are written before the (possibly long) worker calls on purpose: while a weight update
  or a wake runs, the status the planner computed for this pass ("Updating", "WakingUp") is the true one. The next
  pass, which comes right after the calls, records their outcome.
- Pods: created, deleted and (their serving label) patched, all at once. A pod the API server refuses is
  remembered as refused (by spec hash, as a dry run's refusal is) and does not end the pass: the next pass plans
  with it, so the model says so instead of failing every pass with its status frozen.
- Sleeps, wakes and weight updates, all at once; the pass waits for every answer (the planner's maxUnavailable budget
  assumes no update is still running when it plans again). A failed call also becomes a Warning Event.

Every action gets one log line, written once its outcome is known: its `describe()` (safe to log, even for the
Secret) and what came of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from tidal.operator.api import constants as c
from tidal.operator.api.status import InferenceModelStatus
from tidal.operator.builders.owner import spec_hash_of
from tidal.operator.kube.client import KubeApi
from tidal.operator.kube.refusal import RefusedError
from tidal.operator.planner.actions import (
    Action,
    CreateNetworkPolicy,
    CreatePod,
    CreateSecret,
    CreateService,
    DeletePod,
    EmitEvent,
    PatchNetworkPolicy,
    PatchSecret,
    PatchService,
    PatchStatus,
    ReconfigureGroup,
    SetServingLabel,
    SleepRank,
    UpdateWeights,
    WakeRank,
)
from tidal.operator.runtime.memory import EpochFlight, ModelMemory
from tidal.operator.runtime.workers import CallFailure, Target, WorkerCall, WorkerFleet

log = logging.getLogger("tidal.operator.execute")

ChildAction = CreateSecret | PatchSecret | CreateService | PatchService | CreateNetworkPolicy | PatchNetworkPolicy
PodAction = CreatePod | DeletePod | SetServingLabel
StatusAction = PatchStatus | EmitEvent
WorkerAction = SleepRank | WakeRank | UpdateWeights
KubeAction = ChildAction | PodAction | StatusAction

# Which phase carries out which action; together they cover every kind of Action (a unit test holds them to it).
CHILD_ACTIONS = (CreateSecret, PatchSecret, CreateService, PatchService, CreateNetworkPolicy, PatchNetworkPolicy)
GROUP_ACTIONS = (ReconfigureGroup,)
POD_ACTIONS = (CreatePod, DeletePod, SetServingLabel)
STATUS_ACTIONS = (PatchStatus, EmitEvent)
WORKER_ACTIONS = (SleepRank, WakeRank, UpdateWeights)

_FAILURE_REASONS = {
    WorkerCall.SLEEP: "SleepFailed",
    WorkerCall.WAKE_UP: "WakeFailed",
    WorkerCall.WEIGHTS_UPDATE: "WeightsUpdateFailed",
}


def status_patch(status: InferenceModelStatus) -> dict[str, Any]:
    """The status as a merge patch: top-level nulls remove fields (e.g. a cleared weightsRollout); inside lists, which
    a merge patch replaces whole, unset fields are left out (the schema does not accept null there)."""
    out: dict[str, Any] = {}
    for key, value in status.model_dump(mode="json", by_alias=True).items():
        out[key] = _without_nulls(value) if isinstance(value, list) else value
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@dataclass
class Executed:
    acted: bool = False  # anything beyond status and Events was done
    changed_objects: bool = False  # Kubernetes objects were created, patched or deleted
    calls: int = 0  # worker calls made (sleep, wake, weight updates)
    failures: list[CallFailure] = field(default_factory=list)
    updates: list[UpdateWeights] = field(default_factory=list)
    epochs: list[ReconfigureGroup] = field(default_factory=list)  # started, not waited for
    # Per survivors' epoch sent: seconds from the pass being asked for (the failure observed) to the send.
    recovery_send_s: list[float] = field(default_factory=list)

    @property
    def only_failed_worker_calls(self) -> bool:
        """Nothing changed: every worker call failed, answered "not now" (busy, draining, unreachable) or refused
        outright (a sleep or wake with no host memory: nothing in the status holds that refusal, so the next pass
        asks again)."""
        return not self.changed_objects and self.calls > 0 and len(self.failures) == self.calls


@dataclass(frozen=True)
class Context:
    """One pass's model and how to reach its ranks, for everything the executor does besides its actions."""

    body: dict[str, Any]
    namespace: str
    name: str
    control_port: int
    targets: dict[str, Target]
    token: SecretStr | None
    memory: ModelMemory
    # Queues the model for a pass now (after a group's epoch got every answer); None: wait for the next one.
    wake: Callable[[], None] | None = None
    # time.monotonic() when this pass was asked for: the event or timer that let it observe what it acts on.
    asked_at: float | None = None


def _log(ctx: Context, action: Action, outcome: str, level: int = logging.INFO) -> None:
    log.log(level, "%s/%s: %s: %s", ctx.namespace, ctx.name, action.describe(), outcome)


async def _write(kube: KubeApi, ctx: Context, action: KubeAction) -> str:
    """One Kubernetes write; returns what came of it, in a word or two."""
    if isinstance(action, CreatePod | CreateSecret | CreateService | CreateNetworkPolicy):
        return "created" if await kube.create(action.manifest) else "already exists"
    if isinstance(action, PatchSecret | PatchService | PatchNetworkPolicy):
        await kube.patch(action.manifest)
        return "patched"
    if isinstance(action, DeletePod):
        await kube.delete_pod(ctx.namespace, action.name, action.grace_period_seconds)
        return "deleted"
    if isinstance(action, SetServingLabel):
        await kube.patch_pod_labels(ctx.namespace, action.pod, {c.LABEL_SERVING: "true" if action.serving else "false"})
        return "labelled"
    if isinstance(action, PatchStatus):
        await kube.patch_status(ctx.namespace, ctx.name, status_patch(action.status))
        return "written"
    await kube.post_event(ctx.body, action.type, action.reason, action.message)
    return "posted"


async def _apply(kube: KubeApi, ctx: Context, action: KubeAction) -> None:
    try:
        outcome = await _write(kube, ctx, action)
    except Exception as exc:
        if isinstance(exc, RefusedError) and isinstance(action, CreatePod):
            ctx.memory.record_pod_verdict(spec_hash_of(action.manifest), exc.refusal.message)
            _log(ctx, action, f"refused by the API server: {exc.refusal.message}", logging.WARNING)
            return
        # The pass ends here and the reconciler logs the traceback; this line says which action it was.
        _log(ctx, action, f"failed ({type(exc).__name__})", logging.WARNING)
        raise
    _log(ctx, action, outcome)


async def apply_children(kube: KubeApi, ctx: Context, actions: list[Action]) -> bool:
    """Services, the Secret and the NetworkPolicy, one after another; True when there were any."""
    children = [a for a in actions if isinstance(a, CHILD_ACTIONS)]
    for action in children:
        await _apply(kube, ctx, action)
    return bool(children)


async def apply_pods(kube: KubeApi, ctx: Context, actions: list[Action]) -> bool:
    """Create and delete pods, all at once (each stands alone); True when there were any."""
    pods = [a for a in actions if isinstance(a, POD_ACTIONS)]
    await asyncio.gather(*(_apply(kube, ctx, a) for a in pods))
    return bool(pods)


async def write_status(kube: KubeApi, ctx: Context, actions: list[Action]) -> None:
    """The pass's Events, all at once, then the status patch (the planner asks for one only when the status
    changed). Events first: the planner finds transitions by comparing with the written status, so an operator
    that died after the patch but before its Events would never post them (a RankFailed lost that way was seen in
    the operator-killed e2e test); dying before the patch posts them again from the next process instead, and a
    repeated Event is the lesser harm."""
    events = [a for a in actions if isinstance(a, EmitEvent)]
    await asyncio.gather(*(_apply(kube, ctx, a) for a in events))
    for action in actions:
        if isinstance(action, PatchStatus):
            await _apply(kube, ctx, action)


def _epoch_outcome(flight: EpochFlight) -> str:
    if flight.applied:
        return f"applied by ranks {sorted(flight.results)}"
    refused = "; ".join(f"rank {r}: {x.code}: {x.message}" for r, x in sorted(flight.refusals.items()))
    return f"refused: {refused}"


def start_epochs(
    kube: KubeApi, fleet: WorkerFleet, ctx: Context, actions: list[Action]
) -> tuple[list[ReconfigureGroup], list[float]]:
    """Send each group its epoch, in the background (see the module's docstring); returns the epochs started and,
    for the survivors' epochs among them, the seconds from the failure being observed to the send."""
    epochs = [a for a in actions if isinstance(a, ReconfigureGroup)]
    if not epochs:
        return [], []
    if ctx.token is None:
        for action in epochs:
            _log(ctx, action, "skipped: no control token yet")
        return [], []

    def reporter(action: ReconfigureGroup) -> Callable[[EpochFlight], Awaitable[None]]:
        async def report(flight: EpochFlight) -> None:
            outcome = _epoch_outcome(flight)
            _log(ctx, action, outcome, logging.INFO if flight.applied else logging.WARNING)
            try:
                if not flight.applied:
                    message = f"replica {action.replica} epoch {action.epoch} (ranks {flight.members}): {outcome}"
                    await kube.post_event(ctx.body, "Warning", "ReconfigureRefused", message)
            except Exception:
                log.exception("%s/%s: posting the refusal of epoch %d", ctx.namespace, ctx.name, action.epoch)
            finally:
                if ctx.wake is not None:
                    ctx.wake()

        return report

    latencies = []
    for action in epochs:
        fleet.start_epoch(ctx.memory, action, ctx.targets, ctx.control_port, ctx.token, reporter(action))
        if action.recovery and ctx.asked_at is not None:
            latency = time.monotonic() - ctx.asked_at
            latencies.append(latency)
            # Wall-clock times, so that a benchmark on the same machine can put them beside its fault's.
            seen = time.time() - latency
            _log(ctx, action, f"sent to the survivors {latency:.3f}s after the failure was observed (observed at "
                              f"{seen:.6f}, sent at {seen + latency:.6f} unix time)")  # fmt: skip
        else:
            _log(ctx, action, "sent")
    return epochs, latencies


def _failure_line(failure: CallFailure) -> str:
    later = " (asked again on a later pass)" if failure.transient else ""
    return f"failed: {failure.code}: {failure.message}{later}"


async def call_workers(
    kube: KubeApi, fleet: WorkerFleet, ctx: Context, actions: list[Action]
) -> list[tuple[WorkerAction, CallFailure | None]]:
    """Sleeps, wakes and weight updates, all at once; returns each call made with its failure (None: it worked)."""
    sleeps = [a for a in actions if isinstance(a, SleepRank)]
    wakes = [a for a in actions if isinstance(a, WakeRank)]
    updates = [a for a in actions if isinstance(a, UpdateWeights)]
    calls: list[WorkerAction] = [*sleeps, *wakes, *updates]
    if not calls:
        return []
    if ctx.token is None:
        for action in calls:
            _log(ctx, action, "skipped: no control token yet")
        return []
    sleep_failures, wake_failures, update_failures = await asyncio.gather(
        fleet.transition(sleeps, ctx.targets, ctx.control_port, ctx.token),
        fleet.transition(wakes, ctx.targets, ctx.control_port, ctx.token),
        fleet.update_weights(ctx.memory, updates, ctx.targets, ctx.control_port, ctx.token),
    )
    outcomes = list(zip(calls, [*sleep_failures, *wake_failures, *update_failures], strict=True))
    for action, failure in outcomes:
        if failure is None:
            _log(ctx, action, "done")
        else:
            _log(ctx, action, _failure_line(failure), logging.WARNING)
    for failure in (f for _, f in outcomes if f is not None):
        reason = "WorkerUnavailable" if failure.transient else _FAILURE_REASONS[failure.call]
        await kube.post_event(ctx.body, "Warning", reason, f"{failure.pod}: {failure.call}: {failure.message}")
    return outcomes


async def execute(kube: KubeApi, fleet: WorkerFleet, ctx: Context, actions: list[Action]) -> Executed:
    """Run the phases in order; a Kubernetes write that fails ends the pass (the next one plans again)."""
    epochs, recovery_send_s = start_epochs(kube, fleet, ctx, actions)
    children = await apply_children(kube, ctx, actions)
    pods = await apply_pods(kube, ctx, actions)
    await write_status(kube, ctx, actions)
    calls = await call_workers(kube, fleet, ctx, actions)
    return Executed(
        acted=children or pods or bool(calls) or bool(epochs),
        changed_objects=children or pods,
        calls=len(calls),
        failures=[f for _, f in calls if f is not None],
        updates=[a for a, _ in calls if isinstance(a, UpdateWeights)],
        epochs=epochs,
        recovery_send_s=recovery_send_s,
    )
