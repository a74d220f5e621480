"""Facts derived once per pass from the spec and the observations, shared by every part of the planner."""

from dataclasses import dataclass, field, replace
from datetime import datetime

from pydantic import BaseModel, Field, SecretStr

from tidal.contract.control_api import SleepState, WorkerState
from tidal.operator.api.conditions import find_condition
from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.networkpolicy import OperatorIdentity
from tidal.operator.builders.weights import Weights
from tidal.operator.planner.crashloop import failing
from tidal.operator.planner.observed import ObservedChildren, ObservedPod, RankObservation, SentEpoch


class PlanInput(BaseModel):
    """Everything one reconcile pass knows. `fresh_token` is used only if the token Secret is missing or damaged.

    `now` is in whole seconds (conditions' timestamps compare equal across passes); `observed_at` is the precise time
    the observations were taken, for the few timestamps written once (a recovery's milestones); `groups` is, per
    replica, the last epoch this operator process sent (empty after a restart); `pod_refusals` maps the spec hash of
    a pod `pods.pods_to_check` listed to the API server's message refusing it (a dry run, or a create that failed),
    and holds nothing for a pod it admits."""

    model: InferenceModel
    pods: list[ObservedPod]
    ranks: dict[str, RankObservation]
    children: ObservedChildren
    operator: OperatorIdentity
    now: datetime
    fresh_token: SecretStr
    groups: dict[int, SentEpoch] = Field(default_factory=dict)
    pod_refusals: dict[str, str] = Field(default_factory=dict)
    observed_at: datetime | None = None

    @property
    def clock(self) -> datetime:
        return self.observed_at if self.observed_at is not None else self.now


# A rank whose `/state` went unanswered fewer times in a row than this keeps its last answer in the status (its
# rank state, weights version, and its part in WeightsSynced and the phase): a slow answer or a network blip must
# not flip conditions people alert on. Only the status holds it; actions go by this pass's answers.
HOLD_MISSED_READS = 3


@dataclass(frozen=True)
class RankSlot:
    """A (replica, rank) the spec asks for, with what exists for it."""

    replica: int
    rank: int
    name: str
    pod: ObservedPod | None
    observation: RankObservation

    @property
    def state(self) -> WorkerState | None:
        return self.observation.state

    @property
    def loaded(self) -> bool:
        return self.usable and self.state is not None and self.state.model_loaded

    @property
    def usable(self) -> bool:
        """A pod that is there and running (the control API of anything else is not worth calling)."""
        return self.pod is not None and not self.pod.terminating and self.pod.phase == "Running"

    @property
    def ready(self) -> bool:
        return self.usable and self.pod is not None and self.pod.ready

    @property
    def asleep(self) -> bool:
        return self.state is not None and self.state.sleep_state == SleepState.ASLEEP

    @property
    def weights(self) -> Weights | None:
        """What the worker reports serving (None: it does not answer, or has loaded nothing yet)."""
        state = self.state
        if state is None or state.weights_version is None:
            return None
        return Weights(state.weights_version, state.weights_source)

    @property
    def serving(self) -> bool:
        """Ready with its model loaded: taking it out would cost capacity."""
        return self.ready and self.loaded

    def as_reported(self) -> "RankSlot":
        """The slot as the status sees it: a rank that missed its last `/state` reads, fewer than HOLD_MISSED_READS
        in a row, answers what it last said, while its pod stays ready (the kubelet's own probe says the process
        lives; a container down or failing it holds nothing). A rank that refuses the token is not held: it is
        Uncontrolled until its pod is replaced."""
        obs = self.observation
        if obs.state is not None or obs.last_state is None or obs.token_rejected:
            return self
        if obs.missed_reads >= HOLD_MISSED_READS or not self.ready:
            return self
        return replace(
            self, observation=obs.model_copy(update={"state": obs.last_state, "checksum": obs.last_checksum})
        )


@dataclass(frozen=True)
class Facts:
    model: InferenceModel
    slots: list[RankSlot]
    extra_pods: list[ObservedPod]
    replicas: int
    ranks_per_replica: int
    _by_replica: dict[int, list[RankSlot]] = field(default_factory=dict)

    def reported_slots(self) -> list[RankSlot]:
        """The slots as the status sees them (`RankSlot.as_reported`)."""
        return [slot.as_reported() for slot in self.slots]

    def replica_slots(self, replica: int) -> list[RankSlot]:
        return self._by_replica.get(replica, [])

    def replica_available(self, replica: int) -> bool:
        return all(slot.ready for slot in self.replica_slots(replica))

    def running_slots_per_rank(self, replica: int) -> int | None:
        """The expert slots per rank the replica's running ranks report (they agree: a group's members must), for
        a rank created beside them; None when none runs (a new group sizes its slots from its world size)."""
        for slot in self.replica_slots(replica):
            if slot.usable and slot.state is not None and slot.state.group.slots_per_rank is not None:
                return slot.state.group.slots_per_rank
        return None

    def unavailable_replicas(self) -> list[int]:
        return [r for r in range(self.replicas) if not self.replica_available(r)]

    def broken_replicas(self) -> list[int]:
        """Replicas out of service because a pod of theirs keeps failing (a crash loop, or it ended). They do not
        count against maxUnavailable: they serve nothing, so they neither lose capacity to a roll nor give any back
        by waiting, and counting them would keep a new spec (often their fix) from the replicas that serve."""
        degraded = find_condition(self.model.status.conditions, "Degraded") if self.model.status is not None else None

        def broken(slot: RankSlot) -> bool:
            pod = slot.pod
            return pod is not None and not pod.terminating and (pod.finished or failing(pod, degraded))

        return [r for r in range(self.replicas) if any(broken(s) for s in self.replica_slots(r))]


def gather(inp: PlanInput) -> Facts:
    spec, name = inp.model.spec, inp.model.metadata.name
    by_name = {p.name: p for p in inp.pods}
    slots: list[RankSlot] = []
    by_replica: dict[int, list[RankSlot]] = {}
    for replica in range(spec.replicas):
        for rank in range(spec.expert_parallel):
            pod_name = names.pod_name(name, replica, rank)
            slot = RankSlot(replica, rank, pod_name, by_name.get(pod_name), inp.ranks.get(pod_name, RankObservation()))
            slots.append(slot)
            by_replica.setdefault(replica, []).append(slot)
    wanted = {s.name for s in slots}
    extra = [p for p in inp.pods if p.name not in wanted]
    return Facts(inp.model, slots, extra, spec.replicas, spec.expert_parallel, by_replica)
