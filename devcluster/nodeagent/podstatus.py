"""A pod's status as the node reports it, composed from its containers' records (pure)."""

from dataclasses import dataclass
from typing import Any

from tidal.devcluster.nodeagent.lifecycle import ContainerRecord, now_iso, pod_conditions, pod_phase
from tidal.devcluster.nodeagent.node import HOST_IP


@dataclass(frozen=True)
class PodView:
    """What the node knows about a pod right now."""

    init_records: list[ContainerRecord]
    records: list[ContainerRecord]
    initialized: bool
    init_failed: bool  # an init container failed and will not be retried (restartPolicy Never)
    pod_ip: str
    start_time: str


def compose_status(pod: dict[str, Any], view: PodView) -> dict[str, Any]:
    if view.init_failed:
        phase = "Failed"
    elif not view.initialized:
        phase = "Pending"
    else:
        phase = pod_phase(view.records, pod["spec"].get("restartPolicy", "Always"))
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates", [])]
    previous = pod.get("status", {}).get("conditions", [])
    status = {
        "phase": phase,
        "conditions": pod_conditions(view.records, phase, gates, previous, now_iso(), view.initialized),
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "podIP": view.pod_ip,
        "podIPs": [{"ip": view.pod_ip}],
        "startTime": view.start_time,
        "containerStatuses": [r.to_status() for r in view.records],
    }
    if view.init_records:
        status["initContainerStatuses"] = [r.to_status() for r in view.init_records]
    return status


def same_status(new: dict[str, Any], last: dict[str, Any] | None) -> bool:
    """True when patching `new` would change nothing we reported last time.

    Transition times are left out: they are computed against the pod object from the watch, which may lag our
    own last patch, so they can differ without anything having changed.
    """
    if last is None:
        return False

    def without_times(status: dict[str, Any]) -> dict[str, Any]:
        conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]]
        return {**status, "conditions": conditions}

    return without_times(new) == without_times(last)
