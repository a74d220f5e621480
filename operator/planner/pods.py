"""Pods: create missing ranks, replace finished or outdated ones, delete what the spec no longer asks for."""

from dataclasses import dataclass

from tidal.operator.api import constants as c
from tidal.operator.builders.pod import build_pod
from tidal.operator.planner.actions import Action, CreatePod, DeletePod
from tidal.operator.planner.facts import Facts


@dataclass(frozen=True)
class PodPlan:
    actions: list[Action]
    # Replicas that may still be taken out of service in this pass (maxUnavailable minus what is already out).
    budget_left: int
    replaced_replicas: frozenset[int]


def plan_pods(facts: Facts) -> PodPlan:
    model = facts.model
    actions: list[Action] = []
    outdated_by_replica: dict[int, list[tuple[str, str]]] = {}  # replica -> (pod, why it is replaced)
    for slot in facts.slots:
        pod = slot.pod
        if pod is None:
            slots = facts.running_slots_per_rank(slot.replica)
            actions.append(CreatePod(manifest=build_pod(model, slot.replica, slot.rank, slots), reason="missing"))
            continue
        if pod.terminating:
            continue  # the name is taken until the kubelet (or node agent) lets go; created again next pass
        if pod.finished:
            actions.append(DeletePod(name=pod.name, reason=f"pod {pod.phase.lower()}, replacing it"))
            continue
        desired_hash = build_pod(model, slot.replica, slot.rank)["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
        if pod.spec_hash != desired_hash:
            outdated_by_replica.setdefault(slot.replica, []).append((pod.name, "pod spec changed"))
        elif slot.observation.token_rejected:
            # Started with a token the Secret no longer holds: only a new pod reads the current one.
            reason = "its worker rejects the current control token"
            outdated_by_replica.setdefault(slot.replica, []).append((pod.name, reason))
    for pod in facts.extra_pods:
        if not pod.terminating:
            actions.append(DeletePod(name=pod.name, reason="not in the spec any more (scaled down)"))

    # Outdated replicas are replaced whole (ranks of one replica must match), in index order. One that is already
    # out of service costs nothing; a serving one takes a unit of maxUnavailable.
    unavailable = set(facts.unavailable_replicas())
    budget = max(0, model.spec.update_strategy.max_unavailable - len(unavailable))
    replaced = set()
    for replica in sorted(outdated_by_replica):
        if replica not in unavailable:
            if budget == 0:
                continue
            budget -= 1
        replaced.add(replica)
        actions += [DeletePod(name=name, reason=why) for name, why in outdated_by_replica[replica]]
    return PodPlan(actions, budget, frozenset(replaced))
