"""Carry out a plan's actions: Kubernetes objects first, then the status and Events, then the workers' calls.

The status is written before the (possibly long) worker calls on purpose: while a weight update or a wake runs, the
status the planner computed for this pass ("Updating", "WakingUp") is the true one. The next pass, which comes right
after the calls, records their outcome.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from tidal.operator.api.status import InferenceModelStatus
from tidal.operator.kube.client import KubeApi
from tidal.operator.planner.actions import (
    Action,
    CreateNetworkPolicy,
    CreatePod,
    CreateSecret,
    CreateService,
    DeletePod,
    EmitEvent,
    PatchNetworkPolicy,
    PatchService,
    PatchStatus,
    SleepRank,
    UpdateWeights,
    WakeRank,
)
from tidal.operator.runtime.workers import CallFailure, Target, WorkerFleet

log = logging.getLogger("tidal.operator.execute")

_CHILD_CREATES = (CreateSecret, CreateService, CreateNetworkPolicy)
_CHILD_PATCHES = (PatchService, PatchNetworkPolicy)


def status_patch(status: InferenceModelStatus) -> dict[str, Any]:
    """The status as a merge patch: top-level nulls remove fields (e.g. a cleared weightsRollout); inside lists, which
    a merge patch replaces whole, unset fields are left out (the schema does not accept null there)."""
    out: dict[str, Any] = {}
    for key, value in status.model_dump(mode="json", by_alias=True).items():
        if isinstance(value, list):
            value = [{k: v for k, v in item.items() if v is not None} for item in value]
        out[key] = value
    return out


@dataclass
class Executed:
    acted: bool = False  # anything beyond status and Events was done
    changed_objects: bool = False  # Kubernetes objects were created, patched or deleted
    calls: int = 0  # worker calls made (sleep, wake, weight updates)
    failures: list[CallFailure] = field(default_factory=list)
    updates: list[UpdateWeights] = field(default_factory=list)

    @property
    def only_unavailable_workers(self) -> bool:
        """Nothing changed: every worker call was answered "not now" (busy, draining, unreachable)."""
        return (
            not self.changed_objects
            and self.calls > 0
            and len(self.failures) == self.calls
            and all(f.transient for f in self.failures)
        )


@dataclass(frozen=True)
class Context:
    body: dict[str, Any]
    namespace: str
    name: str
    control_port: int
    targets: dict[str, Target]
    token: SecretStr | None


async def execute(kube: KubeApi, fleet: WorkerFleet, ctx: Context, actions: list[Action]) -> Executed:
    done = Executed()
    key = (ctx.namespace, ctx.name)
    pod_calls = []
    for action in actions:
        if isinstance(action, _CHILD_CREATES):
            log.info("%s/%s: %s", *key, action.describe())
            await kube.create(action.manifest)
            done.acted = done.changed_objects = True
        elif isinstance(action, _CHILD_PATCHES):
            log.info("%s/%s: %s", *key, action.describe())
            await kube.patch(action.manifest)
            done.acted = done.changed_objects = True
        elif isinstance(action, CreatePod):
            log.info("%s/%s: %s", *key, action.describe())
            pod_calls.append(kube.create(action.manifest))
        elif isinstance(action, DeletePod):
            log.info("%s/%s: %s", *key, action.describe())
            pod_calls.append(kube.delete_pod(ctx.namespace, action.name))
    if pod_calls:
        await asyncio.gather(*pod_calls)
        done.acted = done.changed_objects = True

    for action in actions:
        if isinstance(action, PatchStatus):
            log.info("%s/%s: %s", *key, action.describe())
            await kube.patch_status(ctx.namespace, ctx.name, status_patch(action.status))
        elif isinstance(action, EmitEvent):
            log.info("%s/%s: %s", *key, action.describe())
            await kube.post_event(ctx.body, action.type, action.reason, action.message)

    transitions = [a for a in actions if isinstance(a, SleepRank | WakeRank)]
    updates = [a for a in actions if isinstance(a, UpdateWeights)]
    if (transitions or updates) and ctx.token is not None:
        for action in transitions + updates:
            log.info("%s/%s: %s", *key, action.describe())
        sleeps = [a for a in transitions if isinstance(a, SleepRank)]
        wakes = [a for a in transitions if isinstance(a, WakeRank)]
        results = await asyncio.gather(
            fleet.transition(key, sleeps, ctx.targets, ctx.control_port, ctx.token),
            fleet.transition(key, wakes, ctx.targets, ctx.control_port, ctx.token),
            fleet.update_weights(key, updates, ctx.targets, ctx.control_port, ctx.token),
        )
        done.failures = [f for group in results for f in group]
        done.calls = len(transitions) + len(updates)
        done.updates = updates
        done.acted = True
    for failure in done.failures:
        log.warning("%s/%s: %s on %s failed: %s", *key, failure.call, failure.pod, failure.message)
        if failure.transient:
            reason = "WorkerUnavailable"  # asked again on the next pass
        else:
            reason = {"sleep": "SleepFailed", "wake_up": "WakeFailed"}.get(failure.call, "WeightsUpdateFailed")
        await kube.post_event(ctx.body, "Warning", reason, f"{failure.pod}: {failure.call}: {failure.message}")
    return done
