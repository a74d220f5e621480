"""Sleep and wake: every rank that is off the desired state gets its call in the same pass (they run in parallel)."""

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from tidal.contract.control_api import SleepState, WorkerState
from tidal.operator.api.conditions import find_condition
from tidal.operator.api.status import Condition, IdleClockStatus
from tidal.operator.planner.actions import Action, SleepRank, WakeRank
from tidal.operator.planner.facts import Facts

SleepReason = Literal["Requested", "IdleTimeout"]


@dataclass(frozen=True)
class SleepDecision:
    asleep: bool
    reason: SleepReason
    idle_clock: IdleClockStatus | None = None  # for the status: see `idle_clock`


def idle_clock(facts: Facts, now: datetime) -> IdleClockStatus | None:
    """The idle timeout and since when it holds: the status's, while the spec's value is unchanged, else from now.
    The workers' idle clocks started long before a timeout that was just set (or shortened), so without this a
    model idle for an hour would sleep in the very pass that sets a timeout of ten minutes."""
    timeout = facts.model.spec.sleep.idle_timeout_seconds
    if timeout is None:
        return None
    status = facts.model.status
    held = status.idle_clock if status is not None else None
    if held is not None and held.seconds == timeout:
        return held
    return IdleClockStatus(seconds=timeout, since=now)


def decide_sleep(facts: Facts, now: datetime) -> SleepDecision:
    """Asleep when the spec says so, or when idleTimeoutSeconds passed on every rank with nothing in flight.

    Level-based: the worker counts requests that arrive while it sleeps (it answers them 503), so a request resets
    `seconds_since_last_request` and the next pass wakes the model. A rank that never saw a request reports None
    and does not count as idle for an awake model; for one asleep for idleness it (like a rank that does not answer)
    does not wake the model. The previous Sleeping condition supplies the rest: a model that fell asleep for
    idleness is woken by any change of its spec (`kubectl patch`, a new generation), and a model that is awake again
    stays awake for at least the timeout (its workers' idle clocks did not move while it slept). Nor does a model
    sleep sooner than the timeout after the timeout was set or changed (`idle_clock`, kept in the status).
    """
    clock = idle_clock(facts, now)
    if facts.model.spec.sleep.state == "Asleep":
        return SleepDecision(True, "Requested", clock)
    states = [s.state for s in facts.slots]
    if clock is None or not states:
        return SleepDecision(False, "Requested", clock)
    timeout = clock.seconds
    awake = SleepDecision(False, "Requested", clock)
    status = facts.model.status
    previous = find_condition(status.conditions, "Sleeping") if status is not None else None
    dozing = _dozing(previous, facts.model.metadata.generation)
    if not dozing:
        if previous is not None and previous.status == "True":
            return awake
        if previous is not None and (now - previous.last_transition_time).total_seconds() < timeout:
            return awake
        if (now - clock.since).total_seconds() < timeout:
            return awake  # idle for a whole timeout counts from when the timeout was set
    idle = all(_idle(st, timeout, dozing) for st in states)
    return SleepDecision(idle, "IdleTimeout" if idle else "Requested", clock)


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


def plan_sleep(facts: Facts, decision: SleepDecision, updating: frozenset[str] = frozenset()) -> list[Action]:
    """`updating`: ranks the roll sends an update in this pass. One still asleep is woken by the next pass, on the
    weights the update staged (`rollout.py`), so a wake never brings back weights the spec no longer asks for."""
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
        elif state.sleep_state == SleepState.ASLEEP and slot.name not in updating:
            actions.append(WakeRank(pod=slot.name))
    return actions
