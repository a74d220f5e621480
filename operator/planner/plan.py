"""The planner's entry point: one level-based pass from (spec, observations) to actions and the next status."""

from dataclasses import dataclass, replace

from tidal.operator.api.conditions import find_condition, flipped
from tidal.operator.api.status import InferenceModelStatus
from tidal.operator.planner.actions import (
    Action,
    CreatePod,
    DeletePod,
    EmitEvent,
    PatchStatus,
    ReconfigureGroup,
    SleepRank,
    UpdateWeights,
    WakeRank,
)
from tidal.operator.planner.children import foreign_children_message, plan_children
from tidal.operator.planner.crashloop import in_crash_loop
from tidal.operator.planner.facts import Facts, PlanInput, gather
from tidal.operator.planner.group_status import group_view
from tidal.operator.planner.groups import decide_groups, group_actions
from tidal.operator.planner.pods import plan_pods, refusal_message
from tidal.operator.planner.rollout import RolloutPlan, plan_rollout
from tidal.operator.planner.sleep import decide_sleep, plan_sleep
from tidal.operator.planner.status import REFUSED_REASON, Progress, compute_status
from tidal.operator.planner.weights import weights_view


@dataclass(frozen=True)
class Plan:
    """The actions of one pass (the executor runs them by phase: see the package docstring) and the status they
    lead to (also inside PatchStatus when it changed)."""

    actions: list[Action]
    status: InferenceModelStatus


def _progress(facts: Facts, work: list[Action], rollout: RolloutPlan, asleep: bool, refused: set[str]) -> Progress:
    """`refused`: pods the API server refuses; a rank waiting for one of them waits for a spec change, not a pod."""
    kinds = {type(a) for a in work}
    if ReconfigureGroup in kinds:
        return Progress("ReconfiguringGroups", "sending expert-parallel groups their next epoch")
    if CreatePod in kinds:
        return Progress("CreatingPods", "creating worker pods")
    if DeletePod in kinds:
        return Progress("ReplacingPods", "replacing or removing worker pods")
    if any(s.pod is not None and s.usable and not s.loaded for s in facts.reported_slots()):
        return Progress("LoadingModel", "waiting for ranks to load the model")
    if SleepRank in kinds:
        return Progress("FallingAsleep", "putting ranks to sleep")
    if WakeRank in kinds:
        return Progress("WakingUp", "waking ranks")
    if UpdateWeights in kinds or rollout.sync == "RollingOut":
        return Progress("RollingWeights", f"rolling weights {rollout.desired_version}")
    waiting = [s for s in facts.slots if s.name not in refused]
    if any(s.pod is None or (not s.ready and not asleep and not s.pod.crash_looping) for s in waiting):
        return Progress("WaitingForPods", "waiting for pods to become ready")
    return Progress(None, "")


def _events(before: InferenceModelStatus | None, after: InferenceModelStatus) -> list[Action]:
    old = before.conditions if before is not None else []
    # Inside a crash loop the other conditions flip with its cycles (a container that loads before it dies turns Ready
    # and WeightsSynced on and off each time); Degraded tells the loop once.
    was, now = find_condition(old, "Degraded"), find_condition(after.conditions, "Degraded")
    looping = in_crash_loop(was) and in_crash_loop(now)
    events: list[Action] = []
    for cond in flipped(old, after.conditions):
        # A condition appearing as False for the first time is noise; its later flips are news.
        if cond.status != "True" and all(c.type != cond.type for c in old):
            continue
        if cond.type == "Progressing":
            continue  # the other conditions tell the story; Progressing flips on every step
        if looping and cond.type != "Degraded":
            continue
        warning = cond.type == "Degraded" and cond.status == "True"
        message = f"{cond.type} is {cond.status}" + (f": {cond.message}" if cond.message else "")
        events.append(EmitEvent(type="Warning" if warning else "Normal", reason=cond.reason, message=message))
    return events


def _refusal_event(before: InferenceModelStatus | None, after: InferenceModelStatus) -> list[Action]:
    """A refusal other than the one Degraded already reported (another message, or Degraded was True for another
    reason) is news too; Degraded flipping to True is posted by `_events`."""
    new = find_condition(after.conditions, "Degraded")
    old = find_condition(before.conditions, "Degraded") if before is not None else None
    if new is None or new.reason != REFUSED_REASON or old is None or old.status != "True":
        return []
    if old.reason == new.reason and old.message == new.message:
        return []
    return [EmitEvent(type="Warning", reason=REFUSED_REASON, message=f"Degraded is True: {new.message}")]


def plan(inp: PlanInput) -> Plan:
    facts = gather(inp)
    previous = inp.model.status
    actions: list[Action] = plan_children(inp.model, inp.children, inp.operator, inp.fresh_token)
    foreign = foreign_children_message(inp.children)
    weights = weights_view(facts, previous)
    pods = plan_pods(facts, inp.pod_refusals, weights.start, frozenset(inp.children.taken_pod_names()))
    if any(key.startswith("Secret/") for key in inp.children.foreign):
        # New pods would mount someone else's Secret as their control token: none is created until it is gone.
        pods = replace(pods, actions=[a for a in pods.actions if not isinstance(a, CreatePod)])
    sleep = decide_sleep(facts, inp.now)
    rollout = plan_rollout(facts, weights, sleep.asleep, pods.budget_left, pods.replaced_replicas)
    updating = frozenset(a.pod for a in rollout.actions if isinstance(a, UpdateWeights))
    sleep_actions = plan_sleep(facts, sleep, updating)
    decisions = decide_groups(facts, inp.groups, sleep.asleep, inp.clock)
    groups = group_view(facts, decisions, previous, inp.clock)
    deleting = {a.name for a in pods.actions if isinstance(a, DeletePod)}
    group_work = [a for a in group_actions(facts, decisions) if not (isinstance(a, DeletePod) and a.name in deleting)]
    # Epochs first: the executor starts them before any other write, as the survivors wait for theirs.
    work = group_work + pods.actions + sleep_actions + rollout.actions
    actions += work
    progress = _progress(facts, work, rollout, sleep.asleep, {r.pod for r in pods.refused})
    refused = refusal_message(pods.refused)
    status = compute_status(facts, previous, sleep, rollout, progress, inp.now, groups, foreign, refused)
    if status != previous or (previous is not None and previous.unread):
        # A status read with values dropped is written anew even where the rest equals this pass's.
        actions.append(PatchStatus(status=status))
    actions += _events(previous, status)
    actions += _refusal_event(previous, status)
    actions += groups.events
    return Plan(actions, status)
