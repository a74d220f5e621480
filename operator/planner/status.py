"""The next status: per-rank table, counts, phase and the five conditions, from this pass's facts and decisions."""

from dataclasses import dataclass
from datetime import datetime

from tidal.operator.api.conditions import find_condition, set_condition
from tidal.operator.api.status import (
    Condition,
    ConditionType,
    InferenceModelStatus,
    Phase,
    RankState,
    RankStatus,
    SleepState,
)
from tidal.operator.builders.services import endpoint
from tidal.operator.planner.crashloop import crash_loop
from tidal.operator.planner.facts import Facts, RankSlot
from tidal.operator.planner.group_status import GroupsView
from tidal.operator.planner.rollout import RolloutPlan
from tidal.operator.planner.scale import current_replicas, scale_selector
from tidal.operator.planner.sleep import SleepDecision
from tidal.operator.planner.weights import served_by

# Degraded's reason (and Progressing's, False) while the API server refuses pods the spec asks for.
REFUSED_REASON = "PodTemplateRefused"


@dataclass(frozen=True)
class Progress:
    """What this pass is doing, as a reason word for Progressing (None: nothing to do)."""

    reason: str | None
    message: str


def rank_state(slot: RankSlot, rollout: RolloutPlan) -> RankState:
    pod = slot.pod
    if pod is None:
        return "Pending"
    if pod.terminating:
        return "Terminating"
    if pod.finished or pod.crash_looping:
        return "Failed"
    if pod.phase != "Running":
        return "Pending"
    if slot.observation.token_rejected:
        # Its worker holds a token the Secret no longer has: it may well serve, but cannot be asked or acted on
        # until its pod is replaced. "Loading" would say it does not serve.
        return "Uncontrolled"
    if slot.state is None or not slot.state.model_loaded:
        return "Loading"
    if slot.asleep:
        return "Asleep"
    if rollout.sync == "RollingOut" and not rollout.view.serves_desired(slot):
        return "Updating"
    return "Ready" if pod.ready else "Loading"


def _weights(slot: RankSlot, previous: InferenceModelStatus | None) -> tuple[str | None, str | None]:
    """(version, source) the worker reports; for a rank that refuses the token, the last ones it reported (what it
    serves, as nothing can have changed its weights since)."""
    if slot.state is not None:
        return slot.state.weights_version, slot.state.weights_source
    if not slot.observation.token_rejected or previous is None:
        return None, None
    row = next((r for r in previous.ranks if r.pod == slot.name), None)
    return (row.weights_version, row.weights_source) if row is not None else (None, None)


def _sleep_state(slots: list[RankSlot]) -> SleepState:
    known = [s for s in slots if s.state is not None]
    if not known:
        return "None"
    asleep = sum(1 for s in known if s.asleep)
    return "Asleep" if asleep == len(known) else "Awake" if asleep == 0 else "Mixed"


def _degraded(
    slots: list[RankSlot],
    rollout: RolloutPlan,
    groups: GroupsView,
    foreign: str | None,
    refused: str | None,
    crashes: tuple[str, str] | None,
) -> tuple[str, str] | None:
    if foreign is not None:
        return "ForeignObject", foreign
    if refused is not None:
        return REFUSED_REASON, refused
    if crashes is not None:
        return crashes
    if rollout.sync == "UpdateFailed" and rollout.failure is not None:
        # Ranks the roll reached before the refusal serve the new weights: say what each serves, not what the
        # status last saw them all agree on.
        return "WeightsUpdateFailed", (
            f"updating weights to {rollout.failure.failed_version} failed ({rollout.failure.message}); the roll is "
            f"stopped with {served_by(slots)} (new pods start on {rollout.view.start.version}). Point spec.weights "
            "at a fixed checkpoint (a new version, or a new source)."
        )
    if rollout.sync == "ChecksumMismatch":
        return "ChecksumMismatch", "ranks report the same weights version with different checksums"
    return groups.degraded()


def _phase(facts: Facts, states: list[RankState], degraded: bool, sleep: SleepDecision, rollout: RolloutPlan) -> Phase:
    if facts.replicas == 0:
        return "Stopped"
    if degraded:
        return "Degraded"
    if sleep.asleep:
        return "Sleeping"
    if any(s == "Pending" for s in states):
        return "Pending"
    if rollout.sync == "RollingOut":
        return "Updating"
    if all(s == "Ready" for s in states):
        return "Ready"
    return "Loading"


def compute_status(
    facts: Facts,
    previous: InferenceModelStatus | None,
    sleep: SleepDecision,
    rollout: RolloutPlan,
    progress: Progress,
    now: datetime,
    groups: GroupsView,
    foreign: str | None = None,
    refused: str | None = None,
) -> InferenceModelStatus:
    """`foreign`: the message about objects under our children's names that are someone else's (Degraded);
    `refused`: the message about pods the spec asks for that the API server refuses (Degraded)."""
    model = facts.model
    generation = model.metadata.generation
    # A rank that briefly misses `/state` keeps its last answer here (`RankSlot.as_reported`); readiness is the pods'.
    slots = facts.reported_slots()
    states = [rank_state(s, rollout) for s in slots]
    ready_ranks = sum(1 for s in slots if s.ready)
    total = len(slots)
    was_degraded = find_condition(previous.conditions, "Degraded") if previous is not None else None
    crashes = crash_loop([s.pod for s in slots if s.pod is not None], was_degraded, now)
    degraded = _degraded(slots, rollout, groups, foreign, refused, crashes)
    sleep_state = _sleep_state(slots)
    all_asleep = total > 0 and all(st == "Asleep" for st in states)
    expert_parallel = facts.ranks_per_replica > 1
    # With expert parallelism a replica serves while its group does, survivors included (Ready, and Degraded).
    every_rank = groups.all_serving if expert_parallel else ready_ranks == total
    serving = total > 0 and every_rank and not any(s.asleep for s in slots)

    conds: list[Condition] = list(previous.conditions) if previous is not None else []

    def put(type_: ConditionType, ok: bool, reason: str, message: str) -> None:
        nonlocal conds
        conds = set_condition(conds, type_, "True" if ok else "False", reason, message, now, generation)

    if total == 0:
        put("Ready", False, "ScaledToZero", "spec.replicas is 0")
    elif serving and expert_parallel:
        in_group = sum(1 for state in groups.rank_states.values() if state == "Serving")
        put("Ready", True, "GroupsServing", f"every replica's group serves ({in_group}/{total} ranks in them)")
    elif serving:
        put("Ready", True, "AllRanksReady", f"{ready_ranks}/{total} ranks ready")
    elif all_asleep:
        put("Ready", False, "Asleep", "every rank is asleep")
    else:
        put("Ready", False, "RanksNotReady", f"{ready_ranks}/{total} ranks ready")
    if progress.reason is None and refused is not None:
        # Nothing moves, and nothing will until the spec changes: not "Reconciled".
        put("Progressing", False, REFUSED_REASON, "the pods the spec asks for are refused (see Degraded)")
    else:
        put("Progressing", progress.reason is not None, progress.reason or "Reconciled", progress.message)
    if degraded is None:
        put("Degraded", False, "AsExpected", "")
    else:
        put("Degraded", True, *degraded)
    if total == 0:
        # No rank to put to sleep or to wake: "FallingAsleep, 0/0" would be a wait that never ends.
        put("Sleeping", False, "ScaledToZero", "spec.replicas is 0")
    elif all_asleep:
        put("Sleeping", True, sleep.reason, "every rank is asleep")
    elif sleep.asleep:
        put("Sleeping", False, "FallingAsleep", f"{states.count('Asleep')}/{total} ranks asleep")
    else:
        put("Sleeping", False, "Awake", "")
    weights = [_weights(s, previous) for s in slots]
    took = sum(1 for s in slots if s.loaded and rollout.view.serves_desired(s))
    # Synced leaves out ranks that serve nothing yet and will start on the desired weights (`weights._agreement`).
    starting = sum(1 for s in slots if not s.loaded)
    sync_messages = {
        "Synced": f"every rank that serves, serves {rollout.desired_version} ({starting} more start on it)"
        if starting
        else f"every rank serves {rollout.desired_version}",
        "RollingOut": f"rolling {rollout.desired_version} into the ranks",
        "WaitingForRanks": f"waiting for every rank to report {rollout.desired_version} and its checksum",
        "PausedWhileAsleep": f"{rollout.desired_version} reaches each rank when the model wakes, before it serves",
        "UpdateFailed": f"the update to {rollout.desired_version} failed: {took}/{total} ranks serve it",
        "ChecksumMismatch": "ranks disagree on the weights' checksum",
        "NoRanks": "no ranks",
    }
    put("WeightsSynced", rollout.sync == "Synced", rollout.sync, sync_messages[rollout.sync])

    return InferenceModelStatus(
        observed_generation=generation,
        phase=_phase(facts, states, degraded is not None, sleep, rollout),
        ready_ranks=ready_ranks,
        total_ranks=total,
        ready=f"{ready_ranks}/{total}",
        replicas=current_replicas(facts),
        selector=scale_selector(facts),
        ranks=[
            RankStatus(
                pod=s.name,
                replica=s.replica,
                rank=s.rank,
                state=state,
                weights_version=version,
                weights_source=source,
                group_state=groups.rank_states.get(s.name),
            )
            for s, state, (version, source) in zip(slots, states, weights, strict=True)
        ],
        weights_version=rollout.served_version,
        weights_source=rollout.view.served.source if rollout.view.served is not None else None,
        weights_rollout=rollout.failure if rollout.sync == "UpdateFailed" else None,
        sleep_state=sleep_state,
        idle_clock=sleep.idle_clock,
        endpoint=endpoint(model),
        groups=groups.groups,
        group_summary=groups.summary(),
        conditions=conds,
    )
