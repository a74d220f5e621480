"""`reconcile(key)`: one level-based pass for one model, written as a script.

get the model -> observe its pods, children and ranks -> plan (pure) -> execute -> say when to come back.
Every trigger (create/update/resume, an owned pod's event, the requeue timer) ends up here through ReconcileQueue.
"""

from __future__ import annotations

import logging
import secrets
import time
from datetime import UTC, datetime

from pydantic import SecretStr, ValidationError

from tidal.operator.api.conditions import find_condition
from tidal.operator.api.resource import InferenceModel
from tidal.operator.api.status import InferenceModelStatus
from tidal.operator.config import OperatorConfig
from tidal.operator.kube.client import KubeApi
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.plan import plan
from tidal.operator.runtime.execute import Context, Executed, execute
from tidal.operator.runtime.observe import observe_kube
from tidal.operator.runtime.workers import WorkerFleet

log = logging.getLogger("tidal.operator.reconcile")

Key = tuple[str, str]
# After acting, look again soon: pods and workers move on their own, and not every move is a pod event.
ACTED_REQUEUE_S = 1.0
MAX_ERROR_BACKOFF_S = 30.0
MAX_ERROR_STREAK = 16  # 2**16 s is far past the cap already


def now_utc() -> datetime:
    # Whole seconds: the status round-trips through JSON, and a timestamp that reads back equal keeps a pass that
    # changed nothing from writing the status again.
    return datetime.now(UTC).replace(microsecond=0)


class Reconciler:
    def __init__(self, kube: KubeApi, fleet: WorkerFleet, metrics: OperatorMetrics, config: OperatorConfig) -> None:
        self._kube = kube
        self._fleet = fleet
        self._metrics = metrics
        self._config = config
        self._errors: dict[Key, int] = {}
        self._unavailable: dict[Key, int] = {}  # passes in a row whose every worker call was answered "not now"
        self._roll_started: dict[Key, tuple[str, float]] = {}

    async def __call__(self, key: Key) -> float | None:
        started = time.monotonic()
        try:
            result, delay = await self._pass(key)
            self._errors.pop(key, None)
        except Exception:
            log.exception("%s/%s: reconcile failed", *key)
            result = "error"
            # The count stops growing at the cap: 2.0**count overflows a float after 1023 failures.
            count = self._errors[key] = min(self._errors.get(key, 0) + 1, MAX_ERROR_STREAK)
            delay = min(MAX_ERROR_BACKOFF_S, 2.0**count)
        self._metrics.reconciles.labels(result).inc()
        self._metrics.reconcile_seconds.observe(time.monotonic() - started)
        return delay

    def forget(self, key: Key) -> None:
        self._errors.pop(key, None)
        self._unavailable.pop(key, None)
        self._roll_started.pop(key, None)
        self._fleet.forget(key)
        self._metrics.set_phase(key, None)

    async def _pass(self, key: Key) -> tuple[str, float | None]:
        body = await self._kube.get_model(*key)
        if body is None:
            self.forget(key)
            return "gone", None
        if body["metadata"].get("deletionTimestamp"):
            return "gone", None  # garbage collection removes the children; nothing to add now
        try:
            model = InferenceModel.model_validate(body)
        except ValidationError as exc:
            # The API server checks the same rules; this happens only with a CRD older than the operator.
            log.error("%s/%s: invalid object, not reconciled: %s", *key, exc)
            return "error", self._config.resync_seconds
        obs = await observe_kube(self._kube, body, model)
        ranks = await self._fleet.observe(key, obs.targets, model.spec.serving.control_port, obs.token)
        result = plan(
            PlanInput(
                model=model,
                pods=obs.pods,
                ranks=ranks,
                children=obs.children,
                operator=self._config.identity(),
                now=now_utc(),
                fresh_token=SecretStr(secrets.token_urlsafe(32)),
            )
        )
        ctx = Context(body, *key, model.spec.serving.control_port, obs.targets, obs.token)
        done = await execute(self._kube, self._fleet, ctx, result.actions)
        self._metrics.set_phase(key, result.status.phase)
        self._track_roll(key, result.status, done)
        if done.only_unavailable_workers:
            # Asked again later, with back-off: each call may hold the rank's requests (a drain) and posts an Event.
            streak = self._unavailable[key] = min(self._unavailable.get(key, 0) + 1, MAX_ERROR_STREAK)
            return "acted", min(MAX_ERROR_BACKOFF_S, 2.0**streak)
        self._unavailable.pop(key, None)
        return ("acted" if done.acted else "ok"), (ACTED_REQUEUE_S if done.acted else self._config.resync_seconds)

    def _track_roll(self, key: Key, status: InferenceModelStatus, done: Executed) -> None:
        if done.updates:
            version = done.updates[0].version
            if self._roll_started.get(key, ("", 0.0))[0] != version:
                self._roll_started[key] = (version, time.monotonic())
        started = self._roll_started.get(key)
        synced = find_condition(status.conditions, "WeightsSynced")
        if started and synced is not None and synced.status == "True" and status.weights_version == started[0]:
            self._metrics.roll_seconds.observe(time.monotonic() - started[1])
            del self._roll_started[key]
