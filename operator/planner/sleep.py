"""Sleep and wake: every rank that is off the desired state gets its call in the same pass (they run in parallel)."""

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from tidal.contract.control_api import ResidentTag, SleepState, WorkerState
from tidal.operator.api.conditions import find_condition
from tidal.operator.api.status import Condition
from tidal.operator.builders.pod import desired_weights
from tidal.operator.planner.actions import Action, SleepRank, UpdateWeights, WakeRank
from tidal.operator.planner.facts import Facts, RankSlot

SleepReason = Literal["Requested", "IdleTimeout"]


@dataclass(frozen=True)
class SleepDecision:
    asleep: bool
    reason: SleepReason


def decide_sleep(facts: Facts, now: datetime) -> SleepDecision:
    """Asleep when the spec says so, or when idleTimeoutSeconds passed on every rank with nothing in flight.

    Level-based: the worker counts requests that arrive while it sleeps (it answers them 503), so a request resets
    `seconds_since_last_request` and the next pass wakes the model. A rank that never saw a request reports None
    and does not count as idle for an awake model; for one asleep for idleness it (like a rank that does not answer)
    does not wake the model. The previous Sleeping condition supplies the rest: a model that fell asleep for
    idleness is woken by any change of its spec (`kubectl patch`, a new generation), and a model that is awake again
    stays awake for at least the timeout (its workers' idle clocks did not move while it slept).
    """
    sleep = facts.model.spec.sleep
    if sleep.state == "Asleep":
        return SleepDecision(True, "Requested")
    timeout = sleep.idle_timeout_seconds
    states = [s.state for s in facts.slots]
    if timeout is None or not states:
        return SleepDecision(False, "Requested")
    status = facts.model.status
    previous = find_condition(status.conditions, "Sleeping") if status is not None else None
    dozing = _dozing(previous, facts.model.metadata.generation)
    if not dozing:
        if previous is not None and previous.status == "True":
            return SleepDecision(False, "Requested")
        if previous is not None and (now - previous.last_transition_time).total_seconds() < timeout:
            return SleepDecision(False, "Requested")
    idle = all(_idle(st, timeout, dozing) for st in states)
    return SleepDecision(idle, "IdleTimeout" if idle else "Requested")


def _dozing(previous: Condition | None, generation: int | None) -> bool:
    """Asleep for idleness, or on the way there, with the spec unchanged since."""
    if previous is None or previous.observed_generation != generation:
        return False
    if previous.status == "True":
        return previous.reason == "IdleTimeout"
    return previous.reason == "FallingAsleep"


def _idle(state: WorkerState | None, timeout: int, dozing: bool) -> bool:
    """A rank that cannot be seen, or a fresh process that has seen no request, counts as idle only for a model
    already sleeping for idleness: it must not wake the model (a rank that restarts comes back awake), but nor may
    it put an awake model to sleep (a new model has seen no request yet either)."""
    if state is None:
        return dozing
    if state.in_flight_requests:
        return False
    if state.seconds_since_last_request is None:
        return dozing
    return state.seconds_since_last_request >= timeout


def plan_sleep(facts: Facts, decision: SleepDecision) -> list[Action]:
    level = facts.model.spec.sleep.level
    actions: list[Action] = []
    for slot in facts.slots:
        if not slot.loaded or slot.state is None:
            continue
        state = slot.state
        if decision.asleep:
            # Deeper is fine to go to; a rank asleep at level 2 already satisfies a level-1 request.
            if state.sleep_state == SleepState.AWAKE or (state.sleep_level or 0) < level:
                actions.append(SleepRank(pod=slot.name, level=level))
        elif state.sleep_state == SleepState.ASLEEP:
            actions.append(_wake(facts, slot, state))
    return actions


def _wake(facts: Facts, slot: RankSlot, state: WorkerState) -> Action:
    """A rank that dropped its weights (level 2) re-reads the version it served when it wakes. Behind the desired
    version, it gets the update first instead: the worker stages it into its host buffer while it sleeps, and the
    wake of the next pass brings back the new weights, one read instead of the old version's and then a roll's.
    Once that version's update failed, the rank wakes on what it has (the roll holds the failure)."""
    source, version = desired_weights(facts.model.spec)
    if state.sleep_level != 2 or ResidentTag.WEIGHTS in state.resident or state.weights_version == version:
        return WakeRank(pod=slot.name)
    failed = slot.observation.update_failure
    held = facts.model.status.weights_rollout if facts.model.status is not None else None
    if (failed is not None and failed.version == version) or (held is not None and held.failed_version == version):
        return WakeRank(pod=slot.name)
    return UpdateWeights(pod=slot.name, replica=slot.replica, source=source, version=version)
