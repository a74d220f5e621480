"""The groups' part of the status (pure): per replica its epoch, members and state, each rank's place in its group,
the last recovery's milestones, the Degraded reason, and the Events of this pass's transitions.

Transitions are found by comparing with the previous status (level-based: a restarted operator does not repeat them):
a rank that served (or was broken with its group) and is now failed starts a recovery (RankFailed); the group serving
in a new epoch is GroupReconfigured (RankRejoined for the ranks it gained), which marks the survivors serving and,
with every rank, the group whole again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tidal.operator.api.status import (
    GroupRankState,
    GroupState,
    InferenceModelStatus,
    RecoveryStatus,
    ReplicaGroupStatus,
)
from tidal.operator.planner.actions import EmitEvent
from tidal.operator.planner.facts import Facts, RankSlot
from tidal.operator.planner.groups import GroupDecision, broken_in, pod_failure, refusal_note, serving_in

SERVING_GROUP_STATES: frozenset[GroupState] = frozenset({"Whole", "Degraded"})
_WAS_IN_GROUP: frozenset[GroupRankState] = frozenset({"Serving", "Broken"})


@dataclass(frozen=True)
class GroupsView:
    groups: list[ReplicaGroupStatus]
    rank_states: dict[str, GroupRankState]  # pod -> its place in the group
    events: list[EmitEvent]

    @property
    def all_serving(self) -> bool:
        return bool(self.groups) and all(g.state in SERVING_GROUP_STATES for g in self.groups)

    def summary(self) -> str | None:
        """InferenceModelStatus.group_summary."""
        if not self.groups:
            return None
        if len(self.groups) == 1:
            group = self.groups[0]
            return f"{group.state} @{group.epoch}"
        whole = sum(g.state == "Whole" for g in self.groups)
        others = [f"r{g.replica} {g.state} @{g.epoch}" for g in self.groups if g.state != "Whole"]
        return ", ".join([f"{whole}/{len(self.groups)} Whole", *others])[:128]

    def degraded(self) -> tuple[str, str] | None:
        """The Degraded reason: a group short of ranks (or not serving after having served), or serving experts
        reloaded from the checkpoint."""
        short = [g for g in self.groups if g.state in ("Degraded", "Broken") or _recovering(g)]
        if short:
            parts = [f"replica {g.replica} is {g.state.lower()} (ranks {g.members} in epoch {g.epoch})" for g in short]
            return "GroupShortOfRanks", "; ".join(parts)
        reloaded = [g for g in self.groups if g.degraded_experts]
        if reloaded:
            parts = [f"replica {g.replica} serves experts {g.degraded_experts} reloaded" for g in reloaded]
            return "ReloadedExperts", "; ".join(parts) + " from the checkpoint (no member held a copy)"
        return None


def _recovering(group: ReplicaGroupStatus) -> bool:
    return group.last_recovery is not None and group.last_recovery.whole_at is None


def rank_group_state(slot: RankSlot, decision: GroupDecision) -> GroupRankState:
    if slot.rank in decision.failures or pod_failure(slot) is not None:
        return "Failed"
    if not slot.loaded:
        # A member briefly silent keeps its place until it counts as failed.
        return "Serving" if slot.state is None and slot.rank in decision.wanted else "Loading"
    if serving_in(slot, decision.view):
        return "Serving"
    if slot.state is not None and broken_in(slot, decision.view):
        return "Broken"
    return "Joining"


def _group_state(decision: GroupDecision, states: dict[int, GroupRankState]) -> GroupState:
    """Whole or Degraded whenever every member of the current epoch serves, even with a next epoch being prepared
    (the old one keeps serving meanwhile): the state says whether the group serves; the message says what moves."""
    view = decision.view
    if view is not None and all(states.get(r) == "Serving" for r in view.members):
        return "Whole" if set(view.members) == set(states) else "Degraded"
    if decision.pending is not None and not decision.pending.refused:
        return "Reconfiguring"
    if view is None:
        return "Forming"
    if any(states.get(r) in ("Broken", "Failed") for r in view.members):
        return "Broken"
    return "Reconfiguring"  # members still switching to the epoch


def _served_at(decision: GroupDecision, clock: datetime) -> datetime:
    """When the view's epoch was applied: the last member's answer, when this process sent it; else now."""
    sent = decision.last_sent  # not `pending`, which is only an epoch newer than the view
    if sent is not None and decision.view is not None and sent.epoch == decision.view.epoch and sent.applied_at:
        return sent.applied_at
    return clock


def _left_the_group(
    before: ReplicaGroupStatus | None,
    view_epoch: int,
    view_members: list[int],
    size: int,
    was_in_group: set[int],
) -> list[int]:
    """Members of the epoch the status recorded that a newer epoch no longer lists, never recorded as failed: they
    failed while no pass wrote the status (an operator restarted between the failure and its record, the survivors'
    epoch already out when the next one looked). Outside the group now, such a rank is not a member of the view,
    so the failure checks, which look at the view's members, never name it. Ranks past the spec's size left by a
    shrink."""
    if before is None or view_epoch <= before.epoch:
        return []
    return [r for r in before.members if r < size and r not in view_members and r in was_in_group]


def _recovery(
    previous: RecoveryStatus | None,
    newly_failed: list[int],
    left: list[int],
    decision: GroupDecision,
    state: GroupState,
    size: int,
    applied_at: datetime,
    clock: datetime,
    recorded_epoch: int,
) -> RecoveryStatus | None:
    view = decision.view
    rec = previous
    lost = sorted({*newly_failed, *left})
    if lost and view is not None:
        if rec is not None and rec.whole_at is None:
            rec = rec.model_copy(update={"failed_ranks": sorted({*rec.failed_ranks, *lost})})
        elif newly_failed:
            # The failure may be seen only once the survivors' epoch is out (an operator restarted meanwhile).
            first = decision.failures.get(newly_failed[0])
            reason = first.reason if first is not None else "it left the group"
            rec = RecoveryStatus(failed_ranks=lost, reason=reason, failed_epoch=view.epoch, failure_seen_at=clock)
        else:
            # Seen only from the epochs: the recorded epoch lost the ranks and the survivors' epoch already serves.
            # When they failed, and so how long the survivors were interrupted, is not known.
            rec = RecoveryStatus(
                failed_ranks=lost,
                reason=f"it left the group (epoch {view.epoch} without it was out before a pass recorded the failure)",
                failed_epoch=recorded_epoch,
                failure_seen_at=clock,
            )
            if state in SERVING_GROUP_STATES:
                rec = rec.model_copy(update={"survivors_epoch": view.epoch, "survivors_serving_at": applied_at})
    if rec is None or rec.whole_at is not None or view is None or state not in SERVING_GROUP_STATES:
        return rec
    if view.epoch <= rec.failed_epoch:
        return rec
    update: dict[str, object] = {}
    if rec.survivors_serving_at is None:
        interruption = max(0.0, (applied_at - rec.failure_seen_at).total_seconds())
        update.update(survivors_epoch=view.epoch, survivors_serving_at=applied_at, interruption_seconds=interruption)
    if len(view.members) == size:
        update["whole_at"] = applied_at
    return rec.model_copy(update=update) if update else rec


def _message(decision: GroupDecision) -> str:
    if decision.send is not None:
        return f"sending epoch {decision.send.epoch}: {decision.send.reason}"
    pending = decision.pending
    if pending is not None and pending.refused:
        return refusal_note(pending)
    return decision.note


def group_view(
    facts: Facts, decisions: list[GroupDecision], previous: InferenceModelStatus | None, clock: datetime
) -> GroupsView:
    previous_groups = {g.replica: g for g in previous.groups} if previous is not None else {}
    previous_ranks = {r.pod: r.group_state for r in previous.ranks} if previous is not None else {}
    groups: list[ReplicaGroupStatus] = []
    rank_states: dict[str, GroupRankState] = {}
    events: list[EmitEvent] = []
    for decision in decisions:
        replica, view = decision.replica, decision.view
        slots = facts.replica_slots(replica)
        states = {s.rank: rank_group_state(s, decision) for s in slots}
        rank_states.update({s.name: states[s.rank] for s in slots})
        state = _group_state(decision, states)
        before = previous_groups.get(replica)
        was_in_group = {s.rank for s in slots if previous_ranks.get(s.name) in _WAS_IN_GROUP}
        newly_failed = [s.rank for s in slots if states[s.rank] == "Failed" and s.rank in was_in_group]
        left = [
            r
            for r in _left_the_group(
                before, view.epoch if view else 0, list(view.members) if view else [], facts.ranks_per_replica,
                was_in_group,
            )
            if r not in newly_failed
        ]  # fmt: skip
        for rank in newly_failed + left:
            why = decision.failures[rank].reason if rank in decision.failures else "it left the group"
            message = f"replica {replica} rank {rank}: {why}"
            events.append(EmitEvent(type="Warning", reason="RankFailed", message=message))
        applied_at = _served_at(decision, clock)
        recovery = _recovery(
            before.last_recovery if before is not None else None,
            newly_failed,
            left,
            decision,
            state,
            facts.ranks_per_replica,
            applied_at,
            clock,
            before.epoch if before is not None else 0,
        )
        serving_members = [r for r in (view.members if view else ()) if states.get(r) == "Serving"]
        degraded_experts: set[int] = set()
        for slot in slots:
            if slot.rank in serving_members and slot.state is not None:
                degraded_experts.update(slot.state.group.degraded_experts)
        group = ReplicaGroupStatus(
            replica=replica,
            state=state,
            epoch=view.epoch if view else 0,
            members=list(view.members) if view else [],
            coordinator_rank=view.coordinator_rank if view else None,
            degraded_experts=sorted(degraded_experts),
            message=_message(decision),
            last_recovery=recovery,
        )
        groups.append(group)
        events += _serving_events(before, group)
    return GroupsView(groups, rank_states, events)


def _serving_events(before: ReplicaGroupStatus | None, group: ReplicaGroupStatus) -> list[EmitEvent]:
    if group.state not in SERVING_GROUP_STATES:
        return []
    if before is not None and before.state in SERVING_GROUP_STATES and before.epoch == group.epoch:
        return []
    message = (
        f"replica {group.replica} serves epoch {group.epoch} with ranks {group.members} "
        f"(coordinator {group.coordinator_rank}; {group.state.lower()})"
    )
    events = [EmitEvent(type="Normal", reason="GroupReconfigured", message=message)]
    if before is not None and before.epoch > 0:
        for rank in sorted(_rejoined(before, group)):
            text = f"replica {group.replica} rank {rank} serves again in epoch {group.epoch}"
            events.append(EmitEvent(type="Normal", reason="RankRejoined", message=text))
    return events


def _rejoined(before: ReplicaGroupStatus, group: ReplicaGroupStatus) -> set[int]:
    """The ranks the group gained since the status last recorded it: members new to the epoch's list, and the failed
    ranks of a recovery that ends in this pass. The second catches the pass that saw the whole epoch half applied
    (state Reconfiguring, its members already listing the returning rank) between the survivors' epoch and this one."""
    gained = set(group.members) - set(before.members)
    previous, recovery = before.last_recovery, group.last_recovery
    if recovery is not None and recovery.whole_at is not None and previous is not None and previous.whole_at is None:
        gained |= set(recovery.failed_ranks) & set(group.members)
    return gained
