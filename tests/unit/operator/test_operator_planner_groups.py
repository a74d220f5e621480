"""Planner: expert-parallel groups. Formation, a failed rank (pod gone, named by a peer, silent) and the survivors'
epoch, the replacement's return, epochs in flight and refused, a restarted operator, serving labels, status, events."""

from datetime import timedelta

import pytest
from operator_fixtures import OPERATOR, T0, TOKEN, all_children, make_model, pod_for, run, with_status, worker

from tidal.operator.api import worker_env as env
from tidal.operator.api.conditions import find_condition
from tidal.operator.planner.actions import (
    CreatePod,
    DeletePod,
    EmitEvent,
    ReconfigureGroup,
    SetServingLabel,
    UpdateWeights,
)
from tidal.operator.planner.facts import PlanInput
from tidal.operator.planner.groups import (
    BROKEN_GRACE_S,
    FAILED_RANK_GRACE_S,
    REFUSAL_RETRY_S,
    SILENT_IN_BROKEN_GROUP_S,
    silent_after_s,
)
from tidal.operator.planner.observed import EpochRefusal, RankObservation, SentEpoch, UpdateFailure
from tidal.operator.planner.plan import plan

N = 4


def ep_model(replicas: int = 1, **spec):
    model = make_model({"replicas": replicas, **spec})
    # The CRD still refuses expertParallel above 1 in this branch (the spec side lifts it): set it past validation.
    model.spec = model.spec.model_copy(update={"expert_parallel": N})
    return model


SILENT_AFTER_S = silent_after_s(ep_model().spec)  # the spec's collective deadline (10 s by default)


def rank_worker(rank: int, epoch: int = 0, members=(), health: str = "waiting", **group) -> RankObservation:
    return worker(
        rank=rank,
        world_size=N,
        group_epoch=epoch,
        coordinator_rank=min(members) if members else 0,
        group_formed=epoch > 0 and len(members) == N,
        group={"health": health, "members": list(members), **group},
    )


def group(model, epoch: int, members, health: str = "serving", loaded=None, serving_label: str | None = None):
    """Pods and states of replica 0: `members` serve (or are `health`) in `epoch`; `loaded` others wait at 0."""
    pods, ranks = [], {}
    for rank in range(N):
        in_epoch = rank in members
        label = serving_label or ("true" if in_epoch and health == "serving" else "false")
        pod = pod_for(model, 0, rank, pod_ip=f"10.0.0.{rank + 1}", group_port=7100, serving_label=label)
        pods.append(pod)
        if in_epoch:
            ranks[pod.name] = rank_worker(rank, epoch, members, health)
        elif loaded is None or rank in loaded:
            ranks[pod.name] = rank_worker(rank)
    return pods, ranks


def ep_with_status(model, result):
    """The model read back with its status (the spec side is set past validation, as in ep_model)."""
    back = with_status(ep_model_spec_as_one(model), result)
    back.spec = back.spec.model_copy(update={"expert_parallel": N})
    return back


def ep_model_spec_as_one(model):
    one = model.model_copy()
    one.spec = model.spec.model_copy(update={"expert_parallel": 1})
    return one


def plan_with(model, pods, ranks, sent=None, seconds: float = 0.0):
    return plan(
        PlanInput(
            model=model, pods=pods, ranks=ranks, children=all_children(model), operator=OPERATOR,
            now=T0 + timedelta(seconds=int(seconds)), fresh_token=TOKEN, groups=sent or {},
            observed_at=T0 + timedelta(seconds=seconds),
        )
    )  # fmt: skip


def epochs(result) -> list[ReconfigureGroup]:
    return [a for a in result.actions if isinstance(a, ReconfigureGroup)]


def only_epoch(result) -> ReconfigureGroup:
    (epoch,) = epochs(result)
    return epoch


def events(result, reason: str) -> list[EmitEvent]:
    return [a for a in result.actions if isinstance(a, EmitEvent) and a.reason == reason]


def sent(epoch: int, members, answered=False, age=0.1, refusals=(), answered_age=None) -> dict[int, SentEpoch]:
    return {
        0: SentEpoch(
            epoch=epoch, members=list(members), coordinator_rank=min(members), sent_at=T0, age_s=age,
            answered=answered, answered_age_s=answered_age, refusals=list(refusals),
        )
    }  # fmt: skip


def test_the_first_epoch_waits_for_every_rank_then_forms_the_group():
    model = ep_model()
    pods, ranks = group(model, 0, (), loaded={0, 1, 2})
    waiting = plan_with(model, pods, ranks)
    assert epochs(waiting) == []
    assert waiting.status.groups[0].state == "Forming" and "3/4" in waiting.status.groups[0].message
    pods, ranks = group(model, 0, ())
    formed = only_epoch(plan_with(model, pods, ranks))
    assert formed.epoch == 1 and formed.coordinator_rank == 0
    assert [(m.rank, m.pod, m.address) for m in formed.members] == [
        (r, f"tiny-r0-{r}", f"10.0.0.{r + 1}:7100") for r in range(N)
    ]
    assert formed.describe().startswith("reconfigure replica 0: epoch 1, ranks [0, 1, 2, 3] of 4, coordinator 0")


def test_a_deleted_pod_sends_the_survivors_epoch_at_once():
    model = ep_model()
    pods, ranks = group(model, 3, range(N))
    del ranks[pods[2].name]
    pods = [p for p in pods if p.rank != 2]
    result = plan_with(model, pods, ranks)
    epoch = only_epoch(result)
    assert epoch.epoch == 4 and [m.rank for m in epoch.members] == [0, 1, 3] and epoch.coordinator_rank == 0
    assert result.actions[0] == epoch  # first, so the executor starts it before anything else
    assert [a.manifest["metadata"]["name"] for a in result.actions if isinstance(a, CreatePod)] == ["tiny-r0-2"]


def test_the_coordinator_failing_hands_the_next_epoch_to_the_lowest_survivor():
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    pods[0] = pods[0].model_copy(update={"terminating": True})
    del ranks[pods[0].name]
    epoch = only_epoch(plan_with(model, pods, ranks))
    assert [m.rank for m in epoch.members] == [1, 2, 3] and epoch.coordinator_rank == 1


def test_a_peer_named_by_a_broken_member_is_left_out_and_its_pod_deleted():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    ranks[pods[1].name] = rank_worker(1, 2, range(N), "broken", broken_peer_rank=3, broken_reason="timeout")
    result = plan_with(model, pods, ranks)
    assert [m.rank for m in only_epoch(result).members] == [0, 1, 2]
    deletes = [a for a in result.actions if isinstance(a, DeletePod)]
    assert [d.name for d in deletes] == ["tiny-r0-3"] and "rank 1 reports epoch 2 broken" in deletes[0].reason
    assert deletes[0].grace_period_seconds == FAILED_RANK_GRACE_S  # a frozen process has nothing to drain
    assert only_epoch(result).recovery
    # A new process under the named rank (it restarted: epoch 0) is not the culprit any more.
    ranks[pods[3].name] = rank_worker(3)
    again = plan_with(model, pods, ranks)
    assert not any(isinstance(a, DeletePod) for a in again.actions)


def test_a_restarted_rank_fails_and_reloads_in_place_while_the_survivors_go_on():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    model = ep_with_status(model, plan_with(model, pods, ranks))  # every rank recorded serving
    ranks[pods[1].name] = rank_worker(1)  # the container restarted after a crash: a new process at epoch 0
    result = plan_with(model, pods, ranks)
    epoch = only_epoch(result)
    assert [m.rank for m in epoch.members] == [0, 2, 3] and epoch.recovery
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # same pod: it reloads, nothing to replace
    assert result.status.ranks[1].group_state == "Failed"
    assert [e.message for e in events(result, "RankFailed")] == [
        "replica 0 rank 1: its worker restarted (a new process, out of the group)"
    ]


def test_a_crashed_rank_named_by_its_peers_before_it_answers_again_keeps_its_pod():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    ranks[pods[0].name] = rank_worker(0, 2, range(N), "broken", broken_peer_rank=1, broken_reason="connection reset")
    del ranks[pods[1].name]  # its new process is still importing torch: no /state yet
    pods[1] = pods[1].model_copy(update={"restart_count": 1, "started_at": T0 - timedelta(seconds=2)})
    result = plan_with(model, pods, ranks)
    assert [m.rank for m in only_epoch(result).members] == [0, 2, 3]
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # it reloads in its pod
    # Before the container restarted (the node has not noticed the exit yet): out of the group, its pod left alone.
    pods[1] = pods[1].model_copy(update={"restart_count": 0, "started_at": T0 - timedelta(seconds=600)})
    ranks[pods[1].name] = RankObservation(silent_for_s=0.1)
    result = plan_with(model, pods, ranks)
    assert [m.rank for m in only_epoch(result).members] == [0, 2, 3]
    assert not any(isinstance(a, DeletePod) for a in result.actions)
    # Silent that long without a restart: frozen, so its pod is replaced (a restart long ago changes nothing).
    pods[1] = pods[1].model_copy(update={"restart_count": 1})
    ranks[pods[1].name] = RankObservation(silent_for_s=SILENT_AFTER_S + 0.1)
    assert "tiny-r0-1" in [a.name for a in plan_with(model, pods, ranks).actions if isinstance(a, DeletePod)]


def test_only_an_epoch_after_a_failure_counts_as_a_recovery():
    model = ep_model()
    pods, ranks = group(model, 0, ())
    assert not only_epoch(plan_with(model, pods, ranks)).recovery  # forming
    pods, ranks = group(model, 3, (0, 1, 2))  # rank 3 loaded again: the whole group's epoch
    assert not only_epoch(plan_with(model, pods, ranks)).recovery


def test_a_silent_rank_fails_only_past_the_threshold():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    ranks[pods[3].name] = RankObservation(silent_for_s=SILENT_AFTER_S / 2)
    brief = plan_with(model, pods, ranks)
    assert epochs(brief) == [] and brief.status.ranks[3].group_state == "Serving"
    ranks[pods[3].name] = RankObservation(silent_for_s=SILENT_AFTER_S + 0.1)
    result = plan_with(model, pods, ranks)
    assert [m.rank for m in only_epoch(result).members] == [0, 1, 2]
    assert "tiny-r0-3" in [a.name for a in result.actions if isinstance(a, DeletePod)]
    assert result.status.ranks[3].group_state == "Failed"


def test_a_silent_member_of_a_broken_epoch_is_left_out_before_its_peers_name_it():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    for rank in (0, 1, 2):  # their collective missed its deadline; the probe of the frozen peer is still running
        ranks[pods[rank].name] = rank_worker(rank, 2, range(N), "broken", broken_for_s=0.1)
    ranks[pods[3].name] = RankObservation(silent_for_s=SILENT_IN_BROKEN_GROUP_S / 2)
    assert epochs(plan_with(model, pods, ranks)) == []  # one missed /state is not enough
    ranks[pods[3].name] = RankObservation(silent_for_s=SILENT_IN_BROKEN_GROUP_S + 0.1)
    result = plan_with(model, pods, ranks)
    assert [m.rank for m in only_epoch(result).members] == [0, 1, 2]
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # deleted only once its silence alone fails it


def test_the_loaded_replacement_gets_the_whole_groups_epoch():
    model = ep_model()
    pods, ranks = group(model, 4, (0, 1, 3))  # rank 2's replacement reports loaded at epoch 0
    epoch = only_epoch(plan_with(model, pods, ranks))
    assert epoch.epoch == 5 and [m.rank for m in epoch.members] == [0, 1, 2, 3] and epoch.coordinator_rank == 0
    pods, ranks = group(model, 4, (0, 1, 3), loaded={0, 1, 3})  # still loading: nothing to send
    assert epochs(plan_with(model, pods, ranks)) == []


V2 = {"weights": {"version": "v2", "source": "ckpt/v2"}}
BASE_DIR, V2_DIR = "/srv/models/tiny-llama", "/srv/models/ckpt/v2"


def on(obs: RankObservation, version: str, source: str) -> RankObservation:
    """`obs` serving `version` from `source`."""
    state = obs.state.model_copy(update={"weights_version": version, "weights_source": source})
    return obs.model_copy(update={"state": state, "checksum": f"sum-{version}"})


def _updated(result) -> list[tuple[str, str]]:
    return [(a.pod, a.version) for a in result.actions if isinstance(a, UpdateWeights)]


def _start_of(create: CreatePod) -> tuple[str | None, str | None]:
    values = {e["name"]: e.get("value") for e in create.manifest["spec"]["containers"][0]["env"]}
    return values.get(env.WEIGHTS_VERSION), values.get(env.WEIGHTS_PATH)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (("base", "tiny-llama"), ("v2", "ckpt/v2")),  # a new version
        (("v2", "ckpt/v2"), ("v2", "ckpt/v2-fixed")),  # a new source under the same version
    ],
)
def test_a_replacement_on_the_new_weights_joins_only_once_its_group_serves_them(before, after):
    # The roll had not reached the group (or its update was cut short) when rank 2's pod was lost: the survivors
    # serve the old weights, and the replacement starts on the desired ones. A token's experts live on several
    # ranks, so a group on two weights answers it with a mix (the workers' lockstep tells versions apart, not
    # sources): rank 2 stays out while the survivors take the new weights, then joins.
    (old, old_dir), (new, new_dir) = [(v, f"/srv/models/{d}") for v, d in (before, after)]
    spec = {} if old == "base" else {"weights": {"version": old, "source": before[1]}}
    served = ep_model(**spec)
    pods, ranks = group(served, 1, range(N))
    ranks = {name: on(obs, old, old_dir) for name, obs in ranks.items()}
    model = ep_with_status(ep_model(weights={"version": new, "source": after[1]}), plan_with(served, pods, ranks))
    lost = plan_with(model, [p for p in pods if p.rank != 2], {k: v for k, v in ranks.items() if k != "tiny-r0-2"})
    assert [m.rank for m in only_epoch(lost).members] == [0, 1, 3]
    (created,) = [a for a in lost.actions if isinstance(a, CreatePod)]
    assert _start_of(created) == (new, new_dir) and _updated(lost) == []

    pods, ranks = group(model, 2, (0, 1, 3), serving_label="true")
    pods[2] = pod_for(model, 0, 2, pod_ip="10.0.0.3", group_port=7100, serving_label="false", ready=False)
    for rank in (0, 1, 3):
        ranks[pods[rank].name] = on(ranks[pods[rank].name], old, old_dir)
    ranks["tiny-r0-2"] = on(ranks["tiny-r0-2"], new, new_dir)  # loaded, at epoch 0
    held = plan_with(model, pods, ranks, seconds=30.0)
    assert epochs(held) == []
    message = held.status.groups[0].message
    assert message.startswith("ranks [2] join once they serve the same weights") and "on tiny-r0-2)" in message
    # Out of service already (not whole), the survivors take the new weights at no cost to maxUnavailable.
    assert _updated(held) == [("tiny-r0-0", new), ("tiny-r0-1", new), ("tiny-r0-3", new)]

    for rank in (0, 1, 3):
        ranks[pods[rank].name] = on(ranks[pods[rank].name], new, new_dir)
    back = plan_with(model, pods, ranks, seconds=40.0)
    assert [m.rank for m in only_epoch(back).members] == [0, 1, 2, 3] and _updated(back) == []


def test_a_rank_restarted_in_place_on_the_weights_its_pod_started_on_is_rolled_before_it_rejoins():
    # The group rolled to v2 in place; its pods still name base as their start weights, so a crashed worker reloads
    # base in its pod. Loaded before a pass saw it loading (no replacement then), it takes v2 before it rejoins.
    base = ep_model()
    pods, ranks = group(base, 2, range(N))
    model = ep_with_status(ep_model(**V2), plan_with(base, pods, ranks))
    for rank in range(N):
        ranks[pods[rank].name] = on(ranks[pods[rank].name], "v2", V2_DIR)
    ranks["tiny-r0-1"] = on(rank_worker(1), "base", BASE_DIR)  # a new process at epoch 0
    pods[1] = pods[1].model_copy(update={"ready": False, "restart_count": 1, "started_at": T0 - timedelta(minutes=5)})
    assert [m.rank for m in only_epoch(plan_with(model, pods, ranks)).members] == [0, 2, 3]  # the survivors'

    _, survivors = group(model, 3, (0, 2, 3))
    for rank in (0, 2, 3):
        ranks[pods[rank].name] = on(survivors[pods[rank].name], "v2", V2_DIR)
    held = plan_with(model, pods, ranks, seconds=10.0)
    assert epochs(held) == [] and _updated(held) == [("tiny-r0-1", "v2")]
    ranks["tiny-r0-1"] = on(rank_worker(1), "v2", V2_DIR)
    back = plan_with(model, pods, ranks, seconds=20.0)
    assert [m.rank for m in only_epoch(back).members] == [0, 1, 2, 3] and _updated(back) == []


def test_a_replacement_after_a_failed_roll_starts_on_what_its_group_serves_and_joins_at_once():
    # The roll to v2 is held as failed: the group kept base, and so does the rank that replaces a lost one.
    base = ep_model()
    pods, ranks = group(base, 1, range(N))
    for rank in range(N):
        ranks[pods[rank].name] = on(ranks[pods[rank].name], "base", BASE_DIR)
    model = ep_with_status(ep_model(**V2), plan_with(base, pods, ranks))
    refused = UpdateFailure(version="v2", message="bad_checkpoint: truncated", source=V2_DIR)
    ranks["tiny-r0-0"] = ranks["tiny-r0-0"].model_copy(update={"update_failure": refused})
    model = ep_with_status(model, plan_with(model, pods, ranks))
    assert model.status.weights_rollout is not None and model.status.weights_rollout.failed_version == "v2"
    lost = plan_with(model, [p for p in pods if p.rank != 2], {k: v for k, v in ranks.items() if k != "tiny-r0-2"})
    (created,) = [a for a in lost.actions if isinstance(a, CreatePod)]
    assert _start_of(created) == ("base", BASE_DIR)
    pods, survivors = group(model, 2, (0, 1, 3))
    ranks = {name: on(obs, "base", BASE_DIR) for name, obs in survivors.items()}  # rank 2 loaded, at epoch 0
    pods[2] = pods[2].model_copy(update={"ready": False, "start_version": "base", "start_source": BASE_DIR})
    back = plan_with(model, pods, ranks, seconds=30.0)
    assert [m.rank for m in only_epoch(back).members] == [0, 1, 2, 3] and _updated(back) == []


def test_no_resend_while_in_flight_and_a_newer_failure_supersedes():
    model = ep_model()
    pods, ranks = group(model, 3, range(N))
    pods = [p for p in pods if p.rank != 2]
    del ranks["tiny-r0-2"]
    flying = plan_with(model, pods, ranks, sent=sent(4, (0, 1, 3)))
    assert epochs(flying) == [] and flying.status.groups[0].state == "Reconfiguring"
    assert "epoch 4 in flight" in flying.status.groups[0].message
    applied = plan_with(model, pods, ranks, sent=sent(4, (0, 1, 3), answered=True, answered_age=0.0))
    assert epochs(applied) == []  # the workers' /state was read before the answers came
    pods = [p for p in pods if p.rank != 1]
    del ranks["tiny-r0-1"]
    newer = only_epoch(plan_with(model, pods, ranks, sent=sent(4, (0, 1, 3))))
    assert newer.epoch == 5 and [m.rank for m in newer.members] == [0, 3]


def test_a_refusal_is_surfaced_and_backed_off_until_the_delay_or_a_change():
    model = ep_model()
    pods, ranks = group(model, 3, range(N))
    pods = [p for p in pods if p.rank != 2]
    del ranks["tiny-r0-2"]
    refusal = EpochRefusal(rank=0, code="experts_unavailable", message="2 slots missing")
    fresh = sent(4, (0, 1, 3), answered=True, refusals=[refusal], answered_age=1.0)
    held = plan_with(model, pods, ranks, sent=fresh)
    assert epochs(held) == []
    assert "refused by rank 0: experts_unavailable: 2 slots missing" in held.status.groups[0].message
    later = sent(4, (0, 1, 3), answered=True, refusals=[refusal], answered_age=REFUSAL_RETRY_S + 1)
    assert only_epoch(plan_with(model, pods, ranks, sent=later)).epoch == 5
    stale = EpochRefusal(rank=1, code="stale_epoch", message="epoch 4 is held by another membership")
    taken = sent(4, (0, 1, 3), answered=True, refusals=[stale], answered_age=0.0)
    assert only_epoch(plan_with(model, pods, ranks, sent=taken)).epoch == 5  # a higher number, at once
    pods = [p for p in pods if p.rank != 3]
    del ranks["tiny-r0-3"]
    assert [m.rank for m in only_epoch(plan_with(model, pods, ranks, sent=fresh)).members] == [0, 1]


def test_a_replacement_rejoins_at_once_when_the_survivors_alone_were_refused():
    # Too few redundant experts: the survivors' epoch (0, 1, 3) was refused, so the view still lists rank 2, and
    # its replacement, loaded at epoch 0, must not wait for a survivors-only epoch that will never apply.
    model = ep_model()
    pods, ranks = group(model, 3, (0, 1, 3), health="broken")
    ranks["tiny-r0-2"] = rank_worker(2)  # the replacement's new process, loaded, outside any epoch
    ranks["tiny-r0-0"] = rank_worker(0, 3, range(N), "broken", broken_peer_rank=2)
    refusal = EpochRefusal(rank=0, code="experts_unavailable", message="2 slots missing")
    refused = sent(4, (0, 1, 3), answered=True, refusals=[refusal], answered_age=1.0)
    for member in (1, 3):
        ranks[f"tiny-r0-{member}"] = rank_worker(member, 3, range(N), "broken", broken_peer_rank=2)
    epoch = only_epoch(plan_with(model, pods, ranks, sent=refused))
    assert epoch.epoch == 5 and [m.rank for m in epoch.members] == [0, 1, 2, 3]
    assert epoch.reason == "with ranks [2] rejoining as new processes" and epoch.coordinator_rank == 0
    # While that epoch is in flight the replacement stays in: no flip back to the refused survivors' epoch.
    assert epochs(plan_with(model, pods, ranks, sent=sent(5, range(N)))) == []
    # A process that started after the epoch was sent never got it (it crashed again): the survivors go on.
    pods[2] = pods[2].model_copy(update={"started_at": T0 + timedelta(seconds=5)})
    again = only_epoch(plan_with(model, pods, ranks, sent=sent(5, range(N)), seconds=6.0))
    assert [m.rank for m in again.members] == [0, 1, 3] and "superseding epoch 5" in again.reason
    pods[2] = pods[2].model_copy(update={"started_at": None})
    # Still loading, it is not taken back: the refused epoch is retried after the delay, as before.
    ranks["tiny-r0-2"] = rank_worker(2).model_copy(
        update={"state": ranks["tiny-r0-2"].state.model_copy(update={"model_loaded": False})}
    )
    assert epochs(plan_with(model, pods, ranks, sent=refused)) == []
    # Restarted and not answering /state yet: not taken back either (nothing says it will load).
    restarted = pods[2].model_copy(update={"restart_count": 1, "started_at": T0 - timedelta(seconds=2)})
    silent = {**ranks, "tiny-r0-2": RankObservation(silent_for_s=0.1)}
    assert epochs(plan_with(model, [*pods[:2], restarted, pods[3]], silent, sent=refused)) == []
    # Once every rank reports the new epoch, the group is whole and nothing more is sent.
    pods, ranks = group(model, 5, range(N))
    assert epochs(plan_with(model, pods, ranks, sent=sent(5, range(N), answered=True, answered_age=0.5))) == []


def test_recovery_times_count_from_when_the_epoch_applied_not_from_the_pass_that_sees_it():
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    model = ep_with_status(model, plan_with(model, pods, ranks))
    lost = [p for p in pods if p.rank != 2]
    failed = plan_with(model, lost, {k: v for k, v in ranks.items() if k != "tiny-r0-2"}, seconds=10.0)
    model = ep_with_status(model, failed)
    # The survivors' epoch applied 1 s after the failure was seen; the next pass looks only at 40 s (one held by a
    # slow weight update, say).
    applied = SentEpoch(
        epoch=2, members=[0, 1, 3], coordinator_rank=0, sent_at=T0 + timedelta(seconds=10), age_s=30.0,
        answered=True, answered_age_s=29.0, applied_at=T0 + timedelta(seconds=11),
    )  # fmt: skip
    survivors_pods, survivors = group(model, 2, (0, 1, 3), loaded={0, 1, 3})
    survivors_pods = [p for p in survivors_pods if p.rank != 2]
    seen_late = plan_with(model, survivors_pods, survivors, sent={0: applied}, seconds=40.0)
    rec = seen_late.status.groups[0].last_recovery
    assert rec.survivors_serving_at == T0 + timedelta(seconds=11) and rec.interruption_seconds == 1.0


def test_a_restarted_operator_resumes_from_the_workers_epochs():
    model = ep_model()
    pods, ranks = group(model, 7, (1, 2, 3))  # rank 0's replacement loaded; memory is empty
    epoch = only_epoch(plan_with(model, pods, ranks))
    assert epoch.epoch == 8 and epoch.coordinator_rank == 1


def test_a_group_broken_with_no_culprit_gets_its_members_again_after_the_grace():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    for rank in range(N):
        ranks[pods[rank].name] = rank_worker(rank, 2, range(N), "broken", broken_for_s=BROKEN_GRACE_S / 2)
    assert epochs(plan_with(model, pods, ranks)) == []
    for rank in range(N):
        ranks[pods[rank].name] = rank_worker(rank, 2, range(N), "broken", broken_for_s=BROKEN_GRACE_S + 0.5)
    epoch = only_epoch(plan_with(model, pods, ranks))
    assert epoch.epoch == 3 and [m.rank for m in epoch.members] == [0, 1, 2, 3]


def test_serving_labels_follow_the_current_epoch():
    model = ep_model()
    pods, ranks = group(model, 2, range(N), serving_label="false")
    labels = [a for a in plan_with(model, pods, ranks).actions if isinstance(a, SetServingLabel)]
    assert [(a.pod, a.serving) for a in labels] == [(f"tiny-r0-{r}", True) for r in range(N)]
    pods, ranks = group(model, 2, range(N), serving_label="true")
    ranks[pods[1].name] = rank_worker(1, 2, range(N), "broken", broken_peer_rank=3)
    labels = [a for a in plan_with(model, pods, ranks).actions if isinstance(a, SetServingLabel)]
    # Rank 1's epoch broke: it keeps its label (its requests wait for the survivors' epoch, not refused); rank 3,
    # which it names, fails and its pod is deleted (no label to flip).
    assert labels == []
    ranks[pods[3].name] = rank_worker(3)  # rank 3 restarted: failed, so out of the Service until it rejoins
    labels = [a for a in plan_with(model, pods, ranks).actions if isinstance(a, SetServingLabel)]
    assert [(a.pod, a.serving) for a in labels] == [("tiny-r0-3", False)]
    pods, ranks = group(model, 0, (), serving_label="false")  # loaded, no epoch yet: nothing to flip
    assert not any(isinstance(a, SetServingLabel) for a in plan_with(model, pods, ranks).actions)


def test_a_recovery_through_status_and_events():
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    whole = plan_with(model, pods, ranks)
    assert whole.status.groups[0].state == "Whole" and whole.status.groups[0].members == [0, 1, 2, 3]
    assert [r.group_state for r in whole.status.ranks] == ["Serving"] * N
    assert events(whole, "GroupReconfigured")
    model = ep_with_status(model, whole)

    lost = [p for p in pods if p.rank != 2]
    lost_ranks = {k: v for k, v in ranks.items() if k != "tiny-r0-2"}
    failed = plan_with(model, lost, lost_ranks, seconds=10.25)
    assert [e.message for e in events(failed, "RankFailed")] == ["replica 0 rank 2: its pod is gone"]
    rec = failed.status.groups[0].last_recovery
    assert rec.failed_ranks == [2] and rec.failed_epoch == 1 and rec.failure_seen_at == T0 + timedelta(seconds=10.25)
    assert failed.status.ranks[2].group_state == "Failed"
    assert find_condition(failed.status.conditions, "Degraded").status == "True"
    model = ep_with_status(model, failed)

    survivors_pods, survivors = group(model, 2, (0, 1, 3), loaded={0, 1, 3})
    survivors_pods = [p for p in survivors_pods if p.rank != 2]
    degraded = plan_with(model, survivors_pods, survivors, seconds=11.0)
    group0 = degraded.status.groups[0]
    assert group0.state == "Degraded" and group0.epoch == 2 and group0.members == [0, 1, 3]
    assert group0.last_recovery.survivors_epoch == 2 and group0.last_recovery.interruption_seconds == 0.75
    assert find_condition(degraded.status.conditions, "Ready").status == "True"
    assert find_condition(degraded.status.conditions, "Degraded").reason == "GroupShortOfRanks"
    assert degraded.status.phase == "Degraded"
    assert not events(degraded, "RankFailed") and events(degraded, "GroupReconfigured")
    model = ep_with_status(model, degraded)

    back_pods, back = group(model, 3, range(N))
    rejoined = plan_with(model, back_pods, back, seconds=30.0)
    group0 = rejoined.status.groups[0]
    assert group0.state == "Whole" and group0.last_recovery.whole_at == T0 + timedelta(seconds=30)
    assert [e.message for e in events(rejoined, "RankRejoined")] == ["replica 0 rank 2 serves again in epoch 3"]
    assert find_condition(rejoined.status.conditions, "Degraded").status == "False"
    quiet = plan_with(ep_with_status(model, rejoined), back_pods, back, seconds=31.0)
    assert quiet.actions == []  # nothing new: no action, no status write, no event repeated


def test_a_rank_rejoins_even_when_a_pass_saw_the_whole_epoch_half_applied():
    # Between the survivors' epoch and the whole one, a pass may see the returning rank already in epoch 3 while the
    # survivors still serve 2: the status then lists epoch 3's members (Reconfiguring), the rank among them.
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    model = ep_with_status(model, plan_with(model, pods, ranks))
    lost_pods = [p for p in pods if p.rank != 2]
    model = ep_with_status(
        model, plan_with(model, lost_pods, {k: v for k, v in ranks.items() if k != "tiny-r0-2"}, seconds=10)
    )
    survivors_pods, survivors = group(model, 2, (0, 1, 3), loaded={0, 1, 3})
    model = ep_with_status(model, plan_with(model, [p for p in survivors_pods if p.rank != 2], survivors, seconds=11))

    back_pods, back = group(model, 3, range(N))
    half = {**back, **{k: v for k, v in survivors.items() if k != "tiny-r0-3"}}  # rank 3 applied epoch 3 first
    half_applied = plan_with(model, back_pods, half, seconds=20)
    assert half_applied.status.groups[0].state == "Reconfiguring" and half_applied.status.groups[0].members == [
        0,
        1,
        2,
        3,
    ]
    assert not events(half_applied, "RankRejoined")
    model = ep_with_status(model, half_applied)

    rejoined = plan_with(model, back_pods, back, seconds=30)
    assert rejoined.status.groups[0].state == "Whole"
    assert [e.message for e in events(rejoined, "RankRejoined")] == ["replica 0 rank 2 serves again in epoch 3"]


def test_reloaded_experts_keep_the_model_degraded():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    ranks[pods[0].name] = rank_worker(0, 2, range(N), "serving", degraded_experts=[5])
    result = plan_with(model, pods, ranks)
    assert result.status.groups[0].degraded_experts == [5]
    assert find_condition(result.status.conditions, "Degraded").reason == "ReloadedExperts"


def test_a_lone_rank_model_has_no_groups():
    model = make_model()
    pods = [pod_for(model, 0)]
    result = run(model, pods, {pods[0].name: worker()})
    assert result.status.groups == [] and result.status.ranks[0].group_state is None
    assert not any(isinstance(a, ReconfigureGroup | SetServingLabel) for a in result.actions)


def test_a_lone_rank_pod_without_the_serving_label_gets_it():
    # A pod made by an operator from before the label: the serving Service selects the label, so it is added.
    model = make_model()
    unlabelled = pod_for(model, 0, serving_label=None)
    result = run(model, [unlabelled], {unlabelled.name: worker()})
    assert [a for a in result.actions if isinstance(a, SetServingLabel)] == [
        SetServingLabel(pod=unlabelled.name, serving=True)
    ]


def test_a_dense_model_in_groups_serves_once_its_ranks_applied_the_epoch():
    # Without experts a worker records the membership and serves on its own (group health "solo").
    model = ep_model()
    pods, ranks = group(model, 2, range(N), health="solo", serving_label="false")
    result = plan_with(model, pods, ranks)
    assert sorted(a.pod for a in result.actions if isinstance(a, SetServingLabel) and a.serving) == [
        p.name for p in pods
    ]


def _resized(model, size: int):
    out = model.model_copy()
    out.spec = model.spec.model_copy(update={"expert_parallel": size})
    return out


def _env_of(manifest) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}


def test_the_group_summary_says_the_state_and_epoch_for_kubectl_get():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    assert plan_with(model, pods, ranks).status.group_summary == "Whole @2"
    del ranks[pods[1].name]
    pods = [p for p in pods if p.rank != 1]
    assert plan_with(model, pods, ranks).status.group_summary == "Broken @2"  # its survivors wait for their epoch
    two = ep_model(replicas=2)
    pods, ranks = group(two, 2, range(N))
    assert plan_with(two, pods, ranks).status.group_summary == "1/2 Whole, r1 Forming @0"


def test_growing_adds_a_rank_with_the_groups_slots_and_keeps_the_others():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    for rank in range(N):
        ranks[pods[rank].name] = rank_worker(rank, 2, range(N), slots_per_rank=3)
    bigger = _resized(model, N + 1)
    result = plan_with(bigger, pods, ranks)
    (created,) = [a for a in result.actions if isinstance(a, CreatePod)]
    env = _env_of(created.manifest)
    assert created.manifest["metadata"]["name"] == "tiny-r0-4"
    assert env["TIDAL_WORLD_SIZE"] == "5" and env["TIDAL_EXPERT_SLOTS_PER_RANK"] == "3"
    assert not any(isinstance(a, DeletePod) for a in result.actions)  # the world size is not in the spec hash
    assert epochs(result) == []  # the new rank is not loaded yet: the group serves on as it is
    new = pod_for(bigger, 0, N, pod_ip="10.0.0.5", group_port=7100, serving_label="false")
    ranks[new.name] = rank_worker(N, slots_per_rank=3)
    epoch = only_epoch(plan_with(bigger, [*pods, new], ranks))
    assert [m.rank for m in epoch.members] == list(range(N + 1)) and epoch.group_size == N + 1
    assert not epoch.recovery


def test_shrinking_sends_the_smaller_epoch_and_removes_the_last_rank_without_a_failure():
    model = ep_model()
    pods, ranks = group(model, 2, range(N))
    smaller = _resized(model, N - 1)
    result = plan_with(smaller, pods, ranks)
    epoch = only_epoch(result)
    assert [m.rank for m in epoch.members] == list(range(N - 1)) and epoch.group_size == N - 1
    assert not epoch.recovery
    assert [a.name for a in result.actions if isinstance(a, DeletePod)] == [f"tiny-r0-{N - 1}"]
    assert events(result, "RankFailed") == []


def test_members_caught_in_the_epoch_before_keep_their_serving_labels():
    # The CI failure this pins: the returning rank applied the whole group's epoch 3 first; a pass then saw the
    # survivors still in 2. Unlabelling them for that pass left the Service with no endpoint at all.
    model = ep_model()
    back_pods, back = group(model, 3, range(N), serving_label="true")
    _, survivors = group(model, 2, (0, 1, 3), loaded={0, 1, 3})
    half = {**back, **{k: v for k, v in survivors.items() if k != "tiny-r0-2"}}
    assert not [a for a in plan_with(model, back_pods, half, seconds=20).actions if isinstance(a, SetServingLabel)]
    # The same in the survivors' epoch: rank 1 applied epoch 2 first while rank 0 still reports epoch 1 broken.
    pods, ranks = group(model, 2, (0, 1, 3), serving_label="true")
    ranks[pods[0].name] = rank_worker(0, 1, range(N), "broken", broken_peer_rank=2)
    labels = [a for a in plan_with(model, pods, ranks).actions if isinstance(a, SetServingLabel)]
    assert [(a.pod, a.serving) for a in labels] == [("tiny-r0-2", False)]
    # A rank left out of the newest epoch loses its label, whatever it still reports.
    pods, ranks = group(model, 2, (0, 1, 3), serving_label="true")
    ranks[pods[2].name] = rank_worker(2, 1, range(N), "serving")
    labels = [a for a in plan_with(model, pods, ranks).actions if isinstance(a, SetServingLabel)]
    assert [(a.pod, a.serving) for a in labels] == [("tiny-r0-2", False)]


def test_a_failure_no_pass_recorded_is_found_from_the_epochs():
    """An operator restarted between a rank's failure and the status write that would have recorded it finds the
    survivors' epoch already out: the rank is outside the view, so no failure check names it, and its new process
    may have reloaded already. The epochs say it left: the recovery is recorded (its interruption unknown) and the
    rank's return completes it."""
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    model = ep_with_status(model, plan_with(model, pods, ranks))  # whole in epoch 1, every rank recorded serving
    pods, ranks = group(model, 2, (0, 2, 3))  # rank 1 restarted, reloaded, waits at epoch 0
    found = plan_with(model, pods, ranks, seconds=20.0)
    assert found.status.ranks[1].group_state == "Joining"  # never "Failed": the old operator saw that
    rec = found.status.groups[0].last_recovery
    assert rec is not None and rec.failed_ranks == [1] and rec.failed_epoch == 1
    assert rec.survivors_epoch == 2 and rec.interruption_seconds is None and rec.whole_at is None
    assert [e.message for e in events(found, "RankFailed")] == ["replica 0 rank 1: it left the group"]
    model = ep_with_status(model, found)
    again = plan_with(model, pods, ranks, seconds=21.0)
    assert not events(again, "RankFailed") and again.status.groups[0].last_recovery == rec  # seen once
    back_pods, back = group(model, 3, range(N))
    whole = plan_with(ep_with_status(model, again), back_pods, back, seconds=30.0)
    assert whole.status.groups[0].last_recovery.whole_at == T0 + timedelta(seconds=30)
    assert [e.message for e in events(whole, "RankRejoined")] == ["replica 0 rank 1 serves again in epoch 3"]


def test_a_shrink_is_not_a_rank_leaving():
    model = ep_model()
    pods, ranks = group(model, 1, range(N))
    model = ep_with_status(model, plan_with(model, pods, ranks))
    smaller = _resized(model, N - 1)
    pods, ranks = group(smaller, 2, range(N - 1))
    result = plan_with(smaller, pods[: N - 1], {k: v for k, v in ranks.items() if not k.endswith(f"-{N - 1}")})
    assert not events(result, "RankFailed")
