"""The scale subresource's status: how many replicas exist, and which pods an autoscaler counts as them."""

from tidal.operator.builders import names
from tidal.operator.planner.facts import Facts


def current_replicas(facts: Facts) -> int:
    """Replicas with at least one pod that is neither terminating nor ended for good, as a Deployment counts its
    pods: a new replica counts once its first pod exists, and one past spec.replicas until its pods are going, so
    status.replicas reaching spec.replicas tells that a scale has been carried out (not that the pods are ready)."""
    pods = [slot.pod for slot in facts.slots if slot.pod is not None] + facts.extra_pods
    return len({pod.replica for pod in pods if not pod.terminating and not pod.finished})


def scale_selector(facts: Facts) -> str:
    return names.selector_string(names.replica_selector(facts.model.metadata.name))
