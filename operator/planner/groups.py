"""Expert-parallel groups, one per replica (pure): which ranks failed, which epoch to send, which pods serve.

Level-based: each pass reads what the workers report (`/state`: group_epoch, group.members, group.health) and the
last epoch this operator process sent (`SentEpoch`; nothing after a restart), and decides again from scratch.
- The group's current epoch: the highest `group_epoch` a running rank reports, with that rank's members.
- Failed: a member of the current epoch whose pod is gone, terminating, finished or crash-looping, whose worker is a
  new process (reports epoch 0, or its container restarted within RESTARTED_WITHIN_S and it does not answer yet),
  that has not answered `/state` for the group's collective deadline (`silent_after_s`), that a member reports as the
  peer that broke the epoch (unless its own worker reports an older epoch: a new process, not the culprit), or that
  is silent for SILENT_IN_BROKEN_GROUP_S while a member reports the epoch broken. A failed rank whose process is
  stuck (silent for the deadline without a restart, or named by a peer while it still answers) has its pod deleted
  with a short grace period, as a frozen process never comes back by itself, so that a replacement is made; a
  restarted one reloads in place.
- Wanted members: the ranks whose pod runs (with an address) and whose worker is loaded, minus the failed ones; a
  member of the current epoch that missed a `/state` or two is kept until it counts as silent. A rank that would
  join (a replacement, a restarted process, a rank of a group forming) is left out while it serves other weights
  (version or source) than the ranks it would serve with: a token's experts live on several ranks, so a group on
  two weights answers it with a mix (the workers' lockstep compares versions only). The roll brings them together
  (`rollout.py`), then it joins.
- The next epoch is one above every epoch seen (reported or sent), so a restarted operator never reuses a number;
  its coordinator is the lowest wanted rank that served in the current epoch (it holds the map the new one is planned
  from), else the lowest wanted rank. It is sent when the wanted members differ from those the group serves in or is
  being moved to (a newer epoch supersedes one in flight); the first epoch waits for every rank to load.
- Not sent: while an epoch with the same members is in flight or applied but not yet reported; after a refusal,
  until REFUSAL_RETRY_S passed or the members change (a stale_epoch refusal is followed at once by a higher number);
  while the model is asleep (a group sleeps and wakes whole; its epoch is taken up after).
- A current epoch reported broken with no culprit (every rank alive, a collective missed its deadline) gets the same
  members again once BROKEN_GRACE_S passed: sooner, the probe of a frozen peer may not have named it yet.
- The serving label is "true" while the rank's worker reports serving in the current epoch, or that epoch broken
  (waiting for the next) without being failed itself; always with expertParallel 1, where the pod builder sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tidal.contract.control_api import GroupHealth
from tidal.contract.error_codes import ErrorCode
from tidal.operator.api.spec import InferenceModelSpec
from tidal.operator.planner.actions import (
    Action,
    DeletePod,
    EpochMemberRef,
    ReconfigureGroup,
    SetServingLabel,
)
from tidal.operator.planner.facts import Facts, RankSlot
from tidal.operator.planner.observed import SentEpoch
from tidal.operator.planner.weights import common_weights, served_by

# A member that has not answered /state (answered off its step loop) for the group's collective deadline is failed:
# the user's own statement of how long a rank may stop answering its peers. Never less than this, as /state is polled
# every GROUP_WATCH_S and a loaded node may miss one.
MIN_SILENT_AFTER_S = 1.0
# Silence that fails a member at once when another member reports the epoch broken (see find_failures).
SILENT_IN_BROKEN_GROUP_S = 0.5
# A group broken with no peer named gets a new epoch this long after it broke (the probe of a frozen peer takes up to
# its deadline; sending sooner would include the frozen peer, whose rendezvous would hang).
BROKEN_GRACE_S = 3.0
# After a refusal (e.g. experts_unavailable), the same members are asked again only this much later.
REFUSAL_RETRY_S = 10.0
# What each member is given to join the epoch and install its map (loading experts included).
RECONFIGURE_TIMEOUT_S = 60.0
# A failed rank's pod is deleted with this grace period (see DeletePod.grace_period_seconds).
FAILED_RANK_GRACE_S = 1
# A member whose container started this recently and whose worker is not in the epoch is a restarted process still
# starting up (its control API answers only once torch is imported): failed, but its pod is left to reload.
RESTARTED_WITHIN_S = 60.0


@dataclass(frozen=True)
class EpochView:
    """The epoch a replica's ranks report serving (or broken) in: the highest any running rank applied."""

    epoch: int
    members: tuple[int, ...]
    coordinator_rank: int


@dataclass(frozen=True)
class RankFailure:
    rank: int
    reason: str
    delete_pod: bool  # its pod still runs (frozen, or named by a peer): delete it so a replacement is made
    new_process: bool = False  # failed only for being a new process outside the epoch (it restarted, or replaced)


@dataclass(frozen=True)
class GroupDecision:
    """One replica's group as this pass sees it, and what it does about it."""

    replica: int
    view: EpochView | None
    pending: SentEpoch | None  # the last epoch sent, while newer than the view
    failures: dict[int, RankFailure]
    wanted: tuple[int, ...]
    send: ReconfigureGroup | None
    note: str  # why nothing is sent although the group is not whole ("" when there is nothing to say)
    last_sent: SentEpoch | None = None  # the last epoch this process sent, applied or not (its applied_at)


def current_view(slots: list[RankSlot]) -> EpochView | None:
    best: EpochView | None = None
    for slot in slots:
        state = slot.state
        if not slot.usable or state is None or state.group_epoch == 0:
            continue
        if best is None or state.group_epoch > best.epoch:
            best = EpochView(state.group_epoch, tuple(sorted(state.group.members)), state.coordinator_rank)
    return best


def serving_in(slot: RankSlot, view: EpochView | None) -> bool:
    state = slot.state
    return (
        view is not None
        and slot.usable
        and state is not None
        and state.group_epoch == view.epoch
        # solo: a dense model with expertParallel > 1 records the membership and serves on its own
        and state.group.health in (GroupHealth.SERVING, GroupHealth.SOLO)
    )


def broken_in(slot: RankSlot, view: EpochView | None) -> bool:
    state = slot.state
    return (
        view is not None
        and state is not None
        and state.group_epoch == view.epoch
        and state.group.health == GroupHealth.BROKEN
    )


def catching_up_to(slot: RankSlot, view: EpochView | None) -> bool:
    """A member of the view's epoch that still reports an older one (serving, broken, or between the two while it
    applies the new one): the pass caught the epoch half applied, its peers first. It serves again within the moment
    the epoch takes. A rank that reloaded reports epoch 0 and is not one."""
    state = slot.state
    return (
        view is not None
        and slot.usable
        and state is not None
        and 0 < state.group_epoch < view.epoch
        and slot.rank in view.members
    )


def pod_failure(slot: RankSlot) -> str | None:
    """Why the rank's pod cannot serve at all (None: it runs, or is still starting)."""
    pod = slot.pod
    if pod is None:
        return "its pod is gone"
    if pod.terminating:
        return "its pod is terminating"
    if pod.finished:
        return f"its pod {pod.phase.lower()}"
    if pod.crash_looping:
        return "its container keeps crashing"
    return None


def restarted_recently(slot: RankSlot, now: datetime) -> bool:
    """The rank's container restarted (a crash) less than RESTARTED_WITHIN_S ago."""
    pod = slot.pod
    if pod is None or pod.restart_count == 0 or pod.started_at is None:
        return False
    return (now - pod.started_at).total_seconds() < RESTARTED_WITHIN_S


def silent_after_s(spec: InferenceModelSpec) -> float:
    return max(MIN_SILENT_AFTER_S, spec.experts.collective_timeout_seconds)


def find_failures(
    slots: list[RankSlot], view: EpochView | None, now: datetime, silent_after: float
) -> dict[int, RankFailure]:
    if view is None:
        return {}
    by_rank = {s.rank: s for s in slots}
    failed: dict[int, RankFailure] = {}
    for rank in view.members:
        slot = by_rank.get(rank)
        if slot is None:
            continue  # the spec no longer asks for this rank (shrunk): it is left out, not failed
        why = pod_failure(slot)
        silent = slot.observation.silent_for_s
        new_process = slot.state is None or slot.state.group_epoch == 0
        if why is not None:
            failed[rank] = RankFailure(rank, why, delete_pod=False)
        elif new_process and restarted_recently(slot, now):
            why = "its container restarted (a new process, out of the group)"
            failed[rank] = RankFailure(rank, why, delete_pod=False, new_process=True)
        elif slot.state is not None and slot.state.group_epoch == 0:
            # Every member of an applied epoch joined it, so a member at epoch 0 is a new process: its container
            # restarted (a crash) and it reloads in place, or its pod was replaced while the view still lists it.
            why = "its worker restarted (a new process, out of the group)"
            failed[rank] = RankFailure(rank, why, delete_pod=False, new_process=True)
        elif slot.usable and slot.state is None and silent is not None and silent >= silent_after:
            failed[rank] = RankFailure(rank, f"its worker has not answered /state for {silent:.1f}s", True)
    for slot in slots:
        state = slot.state
        if state is None or slot.rank not in view.members or slot.rank in failed or not broken_in(slot, view):
            continue
        peer = state.group.broken_peer_rank
        if peer is None or peer == slot.rank or peer not in view.members or peer in failed or peer not in by_rank:
            continue
        peer_slot = by_rank[peer]
        if peer_slot.state is not None and peer_slot.state.group_epoch != view.epoch:
            continue  # the peer's process is a new one (restarted): it left the epoch already
        why = f"rank {slot.rank} reports epoch {view.epoch} broken by it ({state.group.broken_reason or 'no reason'})"
        # Out of the group at once; its pod is replaced only if its process is known to be stuck: it answers /state
        # (alive, yet its peers cannot reach it), or it has been silent long enough without a restart. A crashed
        # process is silent too at first, until its container restarts; it then reloads in its pod.
        silent = peer_slot.observation.silent_for_s or 0.0
        stuck = peer_slot.state is not None or (silent >= silent_after and not restarted_recently(peer_slot, now))
        failed[peer] = RankFailure(peer, why, delete_pod=peer_slot.usable and stuck)
    # A member reports the epoch broken but names no one yet (its probe of a frozen peer runs to its deadline), and
    # a member has missed /state since before: two signs pointing at the same rank, so it is left out now rather than
    # at the end of the probe. Its pod is deleted only once its silence alone would fail it.
    if any(s.state is not None and s.rank not in failed and broken_in(s, view) for s in slots):
        for slot in slots:
            silent = slot.observation.silent_for_s or 0.0
            silent_member = slot.rank in view.members and slot.rank not in failed and slot.state is None
            if silent_member and silent >= SILENT_IN_BROKEN_GROUP_S:
                why = f"its worker has not answered /state for {silent:.1f}s while its group is broken"
                stuck = silent >= silent_after and not restarted_recently(slot, now)
                failed[slot.rank] = RankFailure(slot.rank, why, delete_pod=slot.usable and stuck)
    return failed


def wanted_members(slots: list[RankSlot], view: EpochView | None, failures: dict[int, RankFailure]) -> tuple[int, ...]:
    out = []
    for slot in slots:
        if slot.rank in failures or not slot.usable or slot.pod is None or slot.pod.group_address is None:
            continue
        if slot.state is not None:
            if slot.state.model_loaded:
                out.append(slot.rank)
        elif view is not None and slot.rank in view.members:
            out.append(slot.rank)  # missed a /state or two: kept until silent long enough to count as failed
    return tuple(sorted(out))


def _serving_one_weights(
    slots: list[RankSlot], view: EpochView | None, wanted: tuple[int, ...]
) -> tuple[tuple[int, ...], str]:
    """(`wanted` without the ranks that would join serving other weights than the ranks they would serve with; a
    note when some are left out).

    The ranks that stay are the wanted members of the current epoch that applied one (a new process under a
    member's name is at epoch 0: it joins); a rank joins only on the weights every one of them reports (one that
    missed its `/state` says nothing: joiners wait a pass for it). With none staying (the first epoch), the joiners
    must all serve one weights, or none joins."""
    by_rank = {s.rank: s for s in slots}

    def stays(rank: int) -> bool:
        state = by_rank[rank].state
        return view is not None and rank in view.members and (state is None or state.group_epoch > 0)

    staying = [r for r in wanted if stays(r)]
    joining = [r for r in wanted if not stays(r)]
    if staying:
        held = [by_rank[r].weights for r in staying]
        apart = [r for r in joining if common_weights([*held, by_rank[r].weights]) is None]
    else:
        apart = [] if common_weights([by_rank[r].weights for r in joining]) is not None else joining
    if not apart:
        return wanted, ""
    kept = tuple(r for r in wanted if r not in apart)
    together = served_by([by_rank[r] for r in wanted])
    return kept, f"ranks {apart} join once they serve the same weights as the ranks they would serve with ({together})"


def _new_processes_back_in(
    slots: list[RankSlot], failures: dict[int, RankFailure], among: list[int] | None
) -> dict[int, RankFailure]:
    """`failures` without the ranks (of `among`, if given) failed only for being a new process that answers /state:
    `wanted_members` then takes such a process back once it is loaded.

    Once the epoch of the survivors alone was refused (with too few redundant experts, say, their slots cannot hold
    every expert), the view never drops the failed ranks, so a new process under a failed rank's name would wait
    for a survivors-only epoch that does not come; it rejoins at once instead, and stays wanted while the epoch
    that takes it back is in flight.
    """
    back = {
        s.rank
        for s in slots
        if (failure := failures.get(s.rank)) is not None
        and failure.new_process
        and s.state is not None  # one not answering yet is not kept as "missed a /state" would keep a member
        and (among is None or s.rank in among)
    }
    return {rank: failure for rank, failure in failures.items() if rank not in back}


def _sent_to(slots: list[RankSlot], sent: SentEpoch) -> list[int]:
    """The members of `sent` whose current process was running when it was sent: one that started later (it
    crashed and restarted since) never got that epoch, so the survivors go on without it rather than wait."""
    return [
        s.rank
        for s in slots
        if s.rank in sent.members and (s.pod is None or s.pod.started_at is None or s.pod.started_at <= sent.sent_at)
    ]


def _new_processes(slots: list[RankSlot], wanted: tuple[int, ...]) -> list[int]:
    """Wanted ranks whose process has joined no epoch yet (epoch 0): a new process under a member's name."""
    return [s.rank for s in slots if s.rank in wanted and s.state is not None and s.state.group_epoch == 0]


def _broken_without_culprit(slots: list[RankSlot], view: EpochView) -> bool:
    reports = [s.state for s in slots if s.state is not None and s.rank in view.members and broken_in(s, view)]
    if not reports or any(r.group.broken_peer_rank is not None for r in reports):
        return False
    return max(r.group.broken_for_s or 0.0 for r in reports) >= BROKEN_GRACE_S


def _retry_due(sent: SentEpoch) -> bool:
    if any(r.code == ErrorCode.STALE_EPOCH for r in sent.refusals):
        return True  # another epoch holds the number (a previous operator process sent it): take a higher one
    return sent.answered_age_s is None or sent.answered_age_s >= REFUSAL_RETRY_S


def refusal_note(sent: SentEpoch) -> str:
    first = sent.refusals[0]
    more = f" (and {len(sent.refusals) - 1} more)" if len(sent.refusals) > 1 else ""
    return f"epoch {sent.epoch} was refused by rank {first.rank}: {first.code}: {first.message}{more}"


def _why(view: EpochView | None, wanted: tuple[int, ...], rejoining: list[int]) -> str:
    if view is None:
        return "every rank is loaded: forming the group"
    left, joined = sorted(set(view.members) - set(wanted)), sorted(set(wanted) - set(view.members))
    back = sorted(set(rejoining) & set(view.members))  # new processes under members' names
    parts = ([f"without ranks {left}"] if left else []) + ([f"with ranks {joined} joining"] if joined else [])
    parts += [f"with ranks {back} rejoining as new processes"] if back else []
    return ", ".join(parts) or "the same members again"


def _epoch_to_send(
    slots: list[RankSlot], view: EpochView | None, sent: SentEpoch | None, wanted: tuple[int, ...], size: int
) -> tuple[str | None, str]:
    """(the reason to send an epoch with `wanted`, or None; a note when none is sent)."""
    pending = sent if sent is not None and (view is None or sent.epoch > view.epoch) else None
    rejoining = _new_processes(slots, wanted) if view is not None else []
    if pending is not None and not pending.refused:
        if tuple(pending.members) == wanted:
            state = "in flight" if pending.in_flight else "applied; waiting for the ranks to report it"
            return None, f"epoch {pending.epoch} {state}"
        return _why(view, wanted, rejoining) + f" (superseding epoch {pending.epoch})", ""
    if view is not None and view.members == wanted and not rejoining:
        if _broken_without_culprit(slots, view):
            return f"epoch {view.epoch} broke with no culprit: the same members again", ""
        return None, ""
    if pending is not None and tuple(pending.members) == wanted and not _retry_due(pending):
        return None, refusal_note(pending)
    if view is None and len(wanted) < size:
        return None, f"waiting for every rank to load ({len(wanted)}/{size})"
    return _why(view, wanted, rejoining), ""


def decide_group(
    facts: Facts, replica: int, sent: SentEpoch | None, asleep: bool, reconfigure_timeout_s: float, now: datetime
) -> GroupDecision:
    slots = facts.replica_slots(replica)
    view = current_view(slots)
    pending = sent if sent is not None and (view is None or sent.epoch > view.epoch) else None
    failures = find_failures(slots, view, now, silent_after_s(facts.model.spec))
    wanted = wanted_members(slots, view, failures)
    if pending is not None:
        # The survivors alone were refused, or the last epoch sent already took the new processes back in.
        survivors_refused = pending.refused and tuple(pending.members) == wanted
        among = None if survivors_refused else _sent_to(slots, pending)
        wanted = wanted_members(slots, view, _new_processes_back_in(slots, failures, among))
    wanted, apart = _serving_one_weights(slots, view, wanted)
    if not wanted:
        return GroupDecision(replica, view, pending, failures, wanted, None, apart or "no rank is loaded", sent)
    reason, note = _epoch_to_send(slots, view, sent, wanted, facts.ranks_per_replica)
    if reason is None:
        return GroupDecision(replica, view, pending, failures, wanted, None, note or apart, sent)
    if asleep or any(s.asleep for s in slots if s.rank in wanted):
        return GroupDecision(
            replica, view, pending, failures, wanted, None, "asleep: the epoch waits for the wake", sent
        )
    by_rank = {s.rank: s for s in slots}
    seen = [s.state.group_epoch for s in slots if s.state is not None]
    epoch = max([*seen, view.epoch if view else 0, sent.epoch if sent else 0]) + 1
    stayed = [r for r in wanted if view is not None and r in view.members and _reports(by_rank[r], view.epoch)]
    members = [
        EpochMemberRef(rank=r, pod=by_rank[r].name, address=address)
        for r in wanted
        if (pod := by_rank[r].pod) is not None and (address := pod.group_address) is not None
    ]
    send = ReconfigureGroup(
        replica=replica,
        epoch=epoch,
        members=members,
        coordinator_rank=min(stayed or wanted),
        group_size=facts.ranks_per_replica,
        timeout_s=reconfigure_timeout_s,
        reason=reason,
        recovery=bool(failures),
    )
    return GroupDecision(replica, view, pending, failures, wanted, send, "", sent)


def _reports(slot: RankSlot, epoch: int) -> bool:
    return slot.state is not None and slot.state.group_epoch == epoch


def decide_groups(
    facts: Facts,
    sent: dict[int, SentEpoch],
    asleep: bool,
    now: datetime,
    reconfigure_timeout_s: float = RECONFIGURE_TIMEOUT_S,
) -> list[GroupDecision]:
    if facts.ranks_per_replica <= 1:
        return []
    return [decide_group(facts, r, sent.get(r), asleep, reconfigure_timeout_s, now) for r in range(facts.replicas)]


def group_actions(facts: Facts, decisions: list[GroupDecision]) -> list[Action]:
    """Epochs to send, failed pods to delete, serving labels to flip."""
    actions: list[Action] = [d.send for d in decisions if d.send is not None]
    for decision in decisions:
        names = {s.rank: s.name for s in facts.replica_slots(decision.replica)}
        for failure in decision.failures.values():
            if failure.delete_pod:
                reason = f"rank failed: {failure.reason}"
                grace = FAILED_RANK_GRACE_S
                actions.append(DeletePod(name=names[failure.rank], reason=reason, grace_period_seconds=grace))
    views = {d.replica: d for d in decisions}
    deleted = {a.name for a in actions if isinstance(a, DeletePod)}
    for slot in facts.slots:
        pod = slot.pod
        if pod is None or pod.terminating or slot.name in deleted:
            continue
        if facts.ranks_per_replica <= 1:
            # A lone rank always serves; the builder labels it so at creation, and a pod made by an operator from
            # before the label (none) or one left "false" by a group that shrank to one rank gets it here, since the
            # serving Service selects the label.
            serving = True
        else:
            # A member whose epoch broke keeps the label until it fails or the next epoch leaves it out: its requests
            # wait for the survivors' epoch (well under a second), where taking it out of the Service would refuse
            # new ones on every survivor at once. A broken group that stays so fails its readiness probe instead.
            # So does a member of the newest epoch that a pass sees still in the one before: when the returning
            # rank applies the whole group's epoch first, unlabelling the survivors would leave the Service with no
            # endpoint at all for a pass.
            decision = views[slot.replica]
            view = decision.view
            in_group = serving_in(slot, view) or broken_in(slot, view) or catching_up_to(slot, view)
            serving = in_group and slot.rank not in decision.failures
        if serving != (pod.serving_label == "true") and (serving or pod.serving_label is not None):
            actions.append(SetServingLabel(pod=slot.name, serving=serving))
    return actions
