"""Rolling new weights into running ranks in place: replica by replica, at most maxUnavailable at once.

Weights are a version and a source (`planner/weights.py`): a new source under the same version rolls too, and the
model is not Synced until every rank reports both. A failed update (the worker refuses a bad checkpoint and keeps
its old weights) stops the roll for those weights; the failure is remembered in status.weightsRollout until
spec.weights names other weights. The served weights in status change only when every rank reports the same ones
with the same checksum; ranks that report one version with different checksums are ChecksumMismatch (Degraded)
until spec.weights names other weights, which roll.

While the model sleeps the roll waits: a sleeping rank serves nothing, and reading a checkpoint into a model that may
sleep for long, perhaps through more spec changes, is work for nothing. When the model is to wake, a rank still asleep
behind the desired weights gets its update before its wake (the worker stages it into its host copy while asleep), at
either sleep level: woken first, it would serve the old weights until the roll reached it (level 1), or read them
from disk only to replace them (level 2). In an expert-parallel group whose other ranks are being replaced or still
load (their pods start on the desired weights) the sleepers are updated alone, so the group never forms on two
versions; while an awake rank of the group serves the old weights, they wake on those and the group rolls whole. A
worker that wakes itself for a request (`wakes_on_request`) does not wait for the operator's wake: its sleeping ranks
get their update at once, as if the model were to wake.

An expert-parallel group that is not whole and whose loaded ranks serve two weights (a rank replaced on the desired
weights beside ranks the roll had not reached, or one restarted in place on its pod's older start weights) has its
ranks behind updated at once, at no further cost to maxUnavailable (it is out of service already): the rank that
would join waits outside the group until they serve the same weights (`groups.py`), and a group that is not whole is
otherwise never rolled.
"""

from dataclasses import dataclass
from typing import Literal

from tidal.operator.api.spec import InferenceModelSpec
from tidal.operator.api.status import WeightsRolloutStatus
from tidal.operator.planner.actions import Action, UpdateWeights
from tidal.operator.planner.facts import Facts, RankSlot
from tidal.operator.planner.weights import WeightsView

SyncState = Literal[
    "Synced", "RollingOut", "WaitingForRanks", "PausedWhileAsleep", "UpdateFailed", "ChecksumMismatch", "NoRanks"
]


@dataclass(frozen=True)
class RolloutPlan:
    actions: list[Action]
    view: WeightsView
    sync: SyncState

    @property
    def desired_version(self) -> str:
        return self.view.desired.version

    @property
    def served_version(self) -> str | None:
        return self.view.served.version if self.view.served is not None else None

    @property
    def failure(self) -> WeightsRolloutStatus | None:
        return self.view.failure


ASLEEP_REQUESTS_ENV = "TIDAL_ASLEEP_REQUESTS"  # the worker's setting (worker/lifecycle/config.py: reject | wake)


def wakes_on_request(spec: InferenceModelSpec) -> bool:
    """The workers wake themselves for a request that arrives while they sleep (`spec.worker.env` sets
    TIDAL_ASLEEP_REQUESTS=wake): such a rank serves again before any pass of the operator could update it first."""
    return any(e.name == ASLEEP_REQUESTS_ENV and e.value.strip().lower() == "wake" for e in spec.worker.env)


def plan_rollout(
    facts: Facts, view: WeightsView, asleep: bool, budget: int, skip_replicas: frozenset[int]
) -> RolloutPlan:
    """`asleep`: the model is to sleep (the roll waits, unless its workers wake on a request); `budget`: replicas
    the roll may still take out of service (`PodPlan.budget_left`); `skip_replicas`: those whose pods are being
    replaced in this pass."""
    desired = view.desired
    if not facts.slots:
        return RolloutPlan([], view, "NoRanks")
    if view.agreed is not None and view.agreed.same_as(desired):
        return RolloutPlan([], view, "Synced")
    if view.failure is not None:
        return RolloutPlan([], view, "UpdateFailed")
    behind = [s for s in facts.slots if s.weights is not None and not view.serves_desired(s)]
    if view.mismatch and not behind:
        # The desired weights themselves are served with different checksums. A mismatch on older weights does not
        # stop a roll: new weights are the documented remedy, so they must reach the ranks.
        return RolloutPlan([], view, "ChecksumMismatch")
    if not behind:
        # Nothing reports other weights: ranks are still loading (they start on the desired weights) or checksums
        # are not in yet.
        return RolloutPlan([], view, "WaitingForRanks")
    if asleep and not wakes_on_request(facts.model.spec):
        return RolloutPlan([], view, "PausedWhileAsleep")
    actions: list[Action] = []
    for replica in range(facts.replicas):
        if replica in skip_replicas:
            continue
        slots = facts.replica_slots(replica)
        stale = [s for s in slots if s.weights is not None and not view.serves_desired(s)]
        if not stale:
            continue
        if all(s.loaded and s.asleep for s in slots):
            # A replica still asleep serves nothing: its update costs no capacity, and it is woken only once it
            # holds the desired weights (`sleep.plan_sleep`, or a request it wakes for), never on the old ones.
            actions += _updates(stale, replica, view)
            continue
        if not asleep and not all(s.ready for s in slots) and any(s.loaded and view.serves_desired(s) for s in slots):
            # An expert-parallel group on two weights: a rank back on the desired ones (a replacement starts on
            # them) beside ranks behind, or one restarted in place on its pod's older start weights. Its ranks serve
            # together only on one (`groups.py` keeps the rank that would join out), and a group that is not whole
            # is never rolled below, so its loaded ranks behind take the desired weights now. The replica is out of
            # service already (not every rank is ready) and holds its unit of maxUnavailable, as in `pods.py`.
            actions += _updates([s for s in stale if s.loaded], replica, view)
            continue
        sleeping = [s for s in stale if s.loaded and s.asleep]
        if sleeping and not any(s.loaded and not s.asleep for s in stale):
            # A group whose other ranks are being replaced or still loading (their pods start on the desired
            # weights): its sleeping ranks take the update now, before the wake, or the group would form on two
            # versions. While an awake rank of the group still serves the old weights, the sleepers wake on those
            # too, and the whole group rolls once every rank is ready.
            actions += _updates(sleeping, replica, view)
            continue
        # Only a replica whose every rank is ready and awake is updated; the others get there first (a rank that
        # does not serve and would start on other weights is replaced: `pods.py`).
        if budget == 0 or not all(s.ready and s.loaded and not s.asleep for s in slots):
            continue
        budget -= 1
        actions += _updates(stale, replica, view)
    return RolloutPlan(actions, view, "RollingOut")


def _updates(stale: list[RankSlot], replica: int, view: WeightsView) -> list[Action]:
    desired = view.desired
    source = desired.source or ""
    return [UpdateWeights(pod=s.name, replica=replica, source=source, version=desired.version) for s in stale]
