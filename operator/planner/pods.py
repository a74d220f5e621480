"""Pods: create missing ranks, replace finished or outdated ones, delete what the spec no longer asks for.

A pod is outdated when its spec hash changed, when its `tidal.dev/model`, `replica` or `rank` label was edited (the
Services, the scale selector and the operator's pod list go by them), when its worker rejects the control token,
or when it does not serve
(not ready, model not loaded: pending, loading, crash-looping) and would load other weights at start than a new pod
would (`WeightsView.start`): it cannot take an update in place (only ranks that serve get one), and waiting for it
could be forever (a bad source crash-loops), so it is replaced by a pod that starts on the right weights.

Outdated replicas are replaced within maxUnavailable: replacing one that does not serve costs nothing, and replicas
whose pods keep failing (`Facts.broken_replicas`) do not count as taken, so a broken replica neither blocks its own
fix nor the roll of the others.

A new pod the API server refuses (`PlanInput.pod_refusals`: the runtime dry-runs what `pods_to_check` lists before
planning, and remembers a create it refused) is not created, and no running pod is deleted to make room for it: the
replica keeps the pods it has, and the model is Degraded (`PodTemplateRefused`) with the API server's message. A
template the merge itself cannot apply (`PodTemplateError`: no named containers, no worker container left, or a
container's env or ports malformed; the CRD keeps the template free-form) is refused the same way, with the
operator's message, and is never dry-run.

A rank whose name a pod of someone else's holds (`ObservedChildren.taken_pod_names`) gets no pod: creating one
would fail for as long as that pod is there, and it is never deleted or adopted. The other ranks go on as usual.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidal.operator.builders.merge import PodTemplateError
from tidal.operator.builders.owner import spec_hash_of
from tidal.operator.builders.pod import build_pod
from tidal.operator.builders.weights import Weights
from tidal.operator.planner.actions import Action, CreatePod, DeletePod
from tidal.operator.planner.facts import Facts, PlanInput, RankSlot, gather
from tidal.operator.planner.weights import weights_view

MISSING = "missing"
NAMED_REFUSALS = 3


@dataclass(frozen=True)
class PodToCheck:
    """A pod this pass may create: for a missing rank, or after deleting the running pod of that name (`replaces`)."""

    manifest: dict[str, Any]
    replaces: bool

    @property
    def spec_hash(self) -> str:
        return spec_hash_of(self.manifest)


@dataclass(frozen=True)
class PodRefusal:
    pod: str
    message: str  # the API server's, or why the pod template cannot be merged
    by: str = "the API server"


@dataclass(frozen=True)
class PodPlan:
    actions: list[Action]
    # Replicas that may still be taken out of service in this pass (maxUnavailable minus what is already out).
    budget_left: int
    replaced_replicas: frozenset[int]
    refused: list[PodRefusal]


def _new_pod(facts: Facts, slot: RankSlot, start: Weights) -> tuple[dict[str, Any], str] | None:
    """The pod the slot needs and why (`missing`, or why its running pod goes); None when it needs none now.
    `start`: the weights a pod created now loads at start."""
    pod = slot.pod
    if pod is not None and (pod.terminating or pod.finished):
        return None  # a terminating pod holds the name; a finished one is deleted first (it serves nothing)
    manifest = build_pod(facts.model, slot.replica, slot.rank, facts.running_slots_per_rank(slot.replica), start)
    if pod is None:
        return manifest, MISSING
    if pod.spec_hash != spec_hash_of(manifest):
        return manifest, "pod spec changed"
    if pod.labels_edited:
        # Its labels are part of what it was built as (the spec hash covers them); a new pod has them right.
        return manifest, "its tidal.dev/model, replica or rank label was edited"
    if slot.observation.token_rejected:
        # Started with a token the Secret no longer holds: only a new pod reads the current one.
        return manifest, "its worker rejects the current control token"
    started_on = pod.start_weights
    if not (pod.ready or slot.loaded) and started_on is not None and not started_on.same_as(start):
        return manifest, f"it does not serve and starts on weights {started_on.describe()}, not {start.describe()}"
    return None


def pods_to_check(inp: PlanInput) -> list[PodToCheck]:
    """The pods `plan` may create in this pass or once the pods they replace are gone: the runtime asks the API
    server about each (a dry run) and passes its refusals back in `PlanInput.pod_refusals`."""
    facts = gather(inp)
    start = weights_view(facts, inp.model.status).start
    taken = inp.children.taken_pod_names()
    out = []
    for slot in facts.slots:
        if slot.name in taken:
            continue
        try:
            new = _new_pod(facts, slot, start)
        except PodTemplateError:
            continue  # nothing to ask the API server about: plan_pods reports it
        if new is not None:
            out.append(PodToCheck(manifest=new[0], replaces=new[1] != MISSING))
    return out


def plan_pods(
    facts: Facts, refusals: Mapping[str, str], start: Weights, names_taken: frozenset[str] = frozenset()
) -> PodPlan:
    """`start`: the weights a pod created now loads at start (`WeightsView.start`); `names_taken`: rank pod names a
    pod of someone else's holds (no pod is created under them)."""
    model = facts.model
    actions: list[Action] = []
    refused: list[PodRefusal] = []
    outdated_by_replica: dict[int, list[tuple[str, str]]] = {}  # replica -> (pod, why it is replaced)
    for slot in facts.slots:
        pod = slot.pod
        if pod is not None and pod.finished and not pod.terminating:
            actions.append(DeletePod(name=pod.name, reason=f"pod {pod.phase.lower()}, replacing it"))
            continue
        if slot.name in names_taken:
            continue
        try:
            new = _new_pod(facts, slot, start)
        except PodTemplateError as err:
            refused.append(PodRefusal(slot.name, str(err), by="the operator"))
            continue
        if new is None:
            continue
        manifest, why = new
        refusal = refusals.get(spec_hash_of(manifest))
        if refusal is not None:
            refused.append(PodRefusal(slot.name, refusal))
        elif why == MISSING:
            actions.append(CreatePod(manifest=manifest, reason=why))
        else:
            outdated_by_replica.setdefault(slot.replica, []).append((slot.name, why))
    for pod in facts.extra_pods:
        if not pod.terminating:
            actions.append(DeletePod(name=pod.name, reason="not in the spec any more (scaled down)"))

    # Outdated replicas are replaced whole (ranks of one replica must match), in index order. One that is already
    # out of service costs nothing; a serving one takes a unit of maxUnavailable, of which the replicas out of
    # service already hold one each, except the broken ones. A replica any of whose new pods is refused keeps all
    # its pods.
    blocked = {slot.replica for slot in facts.slots if any(r.pod == slot.name for r in refused)}
    unavailable = set(facts.unavailable_replicas())
    taken = unavailable - set(facts.broken_replicas())
    budget = max(0, model.spec.update_strategy.max_unavailable - len(taken))
    replaced = set()
    for replica in sorted(outdated_by_replica):
        if replica in blocked:
            continue
        if replica not in unavailable:
            if budget == 0:
                continue
            budget -= 1
        replaced.add(replica)
        actions += [DeletePod(name=name, reason=why) for name, why in outdated_by_replica[replica]]
    return PodPlan(actions, budget, frozenset(replaced), refused)


def refusal_message(refused: list[PodRefusal]) -> str | None:
    """The Degraded message while the API server (or the pod-template merge) refuses pods the spec asks for (None:
    none is refused)."""
    if not refused:
        return None
    # A few names: the message must stay short with thousands of ranks (a condition's message is bounded).
    pods = ", ".join(r.pod for r in refused[:NAMED_REFUSALS])
    if len(refused) > NAMED_REFUSALS:
        pods += f" and {len(refused) - NAMED_REFUSALS} more"
    return (
        f"{refused[0].by} refuses the pod the spec asks for ({pods}): {refused[0].message}. No pod is created or "
        "replaced with it, and the running pods are kept: fix spec.worker (its podTemplate)"
    )
