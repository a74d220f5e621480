"""`reconcile(key)`: one level-based pass for one model, written as a script.

get the model -> observe its pods, children and ranks -> ask the API server about the pods the plan may create
(a dry run, `pod_checks.py`) -> plan (pure) -> execute -> say when to come back.
Every trigger (create/update/resume, an owned pod's event, the requeue timer) ends up here through ReconcileQueue.
What a pass leaves for the next one (back-off streaks, the roll's start, checksums, refused updates, the API
server's verdicts on pods) is the model's `ModelMemory`; forgetting a deleted model drops it whole.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import SecretStr, ValidationError

from tidal.operator.api.conditions import find_condition
from tidal.operator.api.resource import InferenceModel
from tidal.operator.api.status import InferenceModelStatus
from tidal.operator.builders.weights import desired_weights
from tidal.operator.config import OperatorConfig
from tidal.operator.kube.client import KubeApi
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.plan import plan
from tidal.operator.planner.pods import pods_to_check
from tidal.operator.runtime.execute import Context, Executed, execute
from tidal.operator.runtime.memory import ModelMemories, ModelMemory, RollStart
from tidal.operator.runtime.observe import observe_kube
from tidal.operator.runtime.pod_checks import check_pods
from tidal.operator.runtime.queue import Key
from tidal.operator.runtime.workers import WorkerFleet
from tidal.operator.workerclient import STATE_TIMEOUT_S

log = logging.getLogger("tidal.operator.reconcile")

# After acting, look again soon: pods and workers move on their own, and not every move is a pod event.
ACTED_REQUEUE_S = 1.0
MAX_ERROR_BACKOFF_S = 30.0
# Expert-parallel models are watched this often: a frozen rank, or a group a worker reports broken, changes no pod.
GROUP_WATCH_S = 0.5
# /state of a group's rank: short, as a frozen rank's call holds the pass that must reconfigure its survivors (the
# worker answers it from its HTTP loop in milliseconds; a miss only starts the rank's silence clock).
GROUP_STATE_TIMEOUT_S = 0.3


def back_off(streak: int) -> float:
    """Seconds to wait after `streak` passes in a row that failed or whose every worker call failed."""
    return min(MAX_ERROR_BACKOFF_S, 2.0**streak)


def now_utc() -> datetime:
    # Whole seconds: the status round-trips through JSON, and a timestamp that reads back equal keeps a pass that
    # changed nothing from writing the status again.
    return datetime.now(UTC).replace(microsecond=0)


class Reconciler:
    def __init__(
        self,
        kube: KubeApi,
        fleet: WorkerFleet,
        metrics: OperatorMetrics,
        config: OperatorConfig,
        requeue: Callable[[Key, float], None] | None = None,
    ) -> None:
        """`requeue(key, delay)` brings a model back sooner (the queue's schedule): a group's epoch answered."""
        self._kube = kube
        self._fleet = fleet
        self._metrics = metrics
        self._config = config
        self._requeue = requeue
        self.memories = ModelMemories()

    async def __call__(self, key: Key, asked_at: float | None = None) -> float | None:
        """One pass; `asked_at` (time.monotonic) is when it was asked for, by default now."""
        started = time.monotonic()
        # Taken once: if the model is forgotten during the pass, the pass writes into a detached object, not the map.
        memory = self.memories.of(key)
        try:
            result, delay = await self._pass(key, memory, started if asked_at is None else asked_at)
            memory.error_streak = 0
        except Exception:
            log.exception("%s/%s: reconcile failed", *key)
            result = "error"
            delay = back_off(memory.count_error())
        self._metrics.reconciles.labels(result).inc()
        self._metrics.reconcile_seconds.observe(time.monotonic() - started)
        return delay

    def forget(self, key: Key) -> None:
        self.memories.forget(key)
        self._metrics.set_phase(key, None)

    async def _pass(self, key: Key, memory: ModelMemory, asked_at: float) -> tuple[str, float | None]:
        body = await self._kube.get_model(*key)
        if body is None:
            self.forget(key)
            return "gone", None
        if body["metadata"].get("deletionTimestamp"):
            return "gone", None  # garbage collection removes the children; nothing to add now
        try:
            model = InferenceModel.model_validate(body)
        except ValidationError as exc:
            # The API server checks the same rules; this happens only with a CRD older than the operator. (The status,
            # this operator's own output, is read leniently and never refused: `InferenceModelStatus.read`.)
            log.error("%s/%s: invalid object, not reconciled: %s", *key, exc)
            return "error", self._config.resync_seconds
        if model.status is not None and model.status.unread:
            # Left by another operator version (a rollback): this pass writes the status anew.
            log.warning("%s/%s: status values this operator does not know were dropped: %s", *key, model.status.unread)
        memory.keep_update_failures_for(desired_weights(model.spec))
        obs = await observe_kube(self._kube, body, model)
        grouped = model.spec.expert_parallel > 1
        timeout = GROUP_STATE_TIMEOUT_S if grouped else STATE_TIMEOUT_S
        port = model.spec.serving.control_port
        ranks = await self._fleet.observe(key, memory, obs.targets, port, obs.token, timeout)
        inp = PlanInput(
            model=model,
            pods=obs.pods,
            ranks=ranks,
            children=obs.children,
            operator=self._config.identity(),
            now=now_utc(),
            fresh_token=SecretStr(secrets.token_urlsafe(32)),
            groups=memory.sent_epochs(),
            observed_at=datetime.now(UTC),
        )
        # Before anything is deleted for them: would the API server take the pods this pass may create?
        refusals = await check_pods(self._kube, key, memory, pods_to_check(inp))
        result = plan(inp.model_copy(update={"pod_refusals": refusals}))
        requeue = self._requeue
        wake = (lambda: requeue(key, 0.0)) if requeue is not None else None
        ctx = Context(body, *key, port, obs.targets, obs.token, memory, wake, asked_at)
        done = await execute(self._kube, self._fleet, ctx, result.actions)
        for seconds in done.recovery_send_s:
            self._metrics.recovery_send_seconds.observe(seconds)
        self._metrics.set_phase(key, result.status.phase)
        self._track_roll(memory, result.status, done)
        if done.only_failed_worker_calls:
            # Asked again later, with back-off: each call may hold the rank's requests (a drain) and posts an Event.
            return "acted", back_off(memory.count_failed_calls())
        memory.failed_calls_streak = 0
        delay = ACTED_REQUEUE_S if done.acted else self._config.resync_seconds
        if grouped:
            delay = min(delay, GROUP_WATCH_S)
        return ("acted" if done.acted else "ok"), delay

    def _track_roll(self, memory: ModelMemory, status: InferenceModelStatus, done: Executed) -> None:
        if done.updates:
            version = done.updates[0].version
            if memory.roll is None or memory.roll.version != version:
                memory.roll = RollStart(version, time.monotonic())
        roll = memory.roll
        if roll is None or status.weights_version != roll.version:
            return
        synced = find_condition(status.conditions, "WeightsSynced")
        if synced is not None and synced.status == "True":
            self._metrics.roll_seconds.observe(time.monotonic() - roll.started)
            memory.roll = None
