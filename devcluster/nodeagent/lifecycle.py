"""The kubelet's bookkeeping rules, pure: restart policy, back-off, pod phase, conditions and container statuses."""

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

TERMINAL_PHASES = ("Succeeded", "Failed")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRecord:
    """What the node knows about one container, in the API's own shapes (state/lastState are ContainerState dicts)."""

    name: str
    image: str
    restart_count: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    container_id: str = ""

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def last_exit_code(self) -> int | None:
        for state in (self.state, self.last_state):
            if "terminated" in state:
                return int(state["terminated"]["exitCode"])
        return None

    def to_status(self) -> dict[str, Any]:
        status = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def carry_over(record: ContainerRecord, previous: dict[str, Any], pod_start_time: str) -> None:
    """Take over a container's status from an earlier node agent: its restart count, and if it was running,
    the fact that that run has ended (its process went with the old agent)."""
    record.restart_count = int(previous.get("restartCount", 0))
    if previous.get("state", {}).get("running"):
        started = previous["state"]["running"].get("startedAt", pod_start_time)
        record.last_state = terminated_state(137, started, now_iso(), "the node agent restarted")


def should_restart(restart_policy: str, exit_code: int) -> bool:
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def backoff_delay(crashes_in_a_row: int, initial_s: float, max_s: float) -> float:
    """Doubling delay after the n-th back-off of a crash streak, 0 for none (the kubelet uses 10 s to 5 min; we
    default shorter). The caller passes the crashes before this one: a streak's first restart is immediate."""
    if crashes_in_a_row <= 0:
        return 0.0
    return min(max_s, initial_s * 2.0 ** (crashes_in_a_row - 1))


def terminated_state(
    exit_code: int, started_at: str, finished_at: str, message: str = "", reason: str = ""
) -> dict[str, Any]:
    reason = reason or ("Completed" if exit_code == 0 else "Error")
    state = {"exitCode": exit_code, "reason": reason, "startedAt": started_at, "finishedAt": finished_at}
    if message:
        state["message"] = message
    return {"terminated": state}


def pod_phase(records: list[ContainerRecord], restart_policy: str) -> str:
    """Pending until every container has started once, then Running until none will run again."""
    waiting = running = stopped = succeeded = 0
    for rec in records:
        if rec.running:
            running += 1
        elif "terminated" in rec.state or "terminated" in rec.last_state:
            stopped += 1
            if rec.last_exit_code == 0:
                succeeded += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if not stopped:
        return "Pending"
    if restart_policy == "Always":
        return "Running"
    if stopped == succeeded:
        return "Succeeded"
    if restart_policy == "Never":
        return "Failed"
    return "Running"


def _condition(
    ctype: str, ok: bool, previous: dict[str, dict[str, Any]], now: str, reason: str = "", message: str = ""
) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(ctype) or {}
    # lastTransitionTime moves only when the status flips, so watchers can tell how long a state has held.
    moved = old.get("status") != status
    cond = {"type": ctype, "status": status, "lastTransitionTime": now if moved else old.get("lastTransitionTime", now)}
    # The status patch merges conditions by type: a key left out keeps its old value, so a condition that turns True
    # would keep the reason and message it had while False. None removes them.
    cond["reason"] = reason if reason and not ok else None
    cond["message"] = message if message and not ok else None
    return cond


def pod_conditions(
    records: list[ContainerRecord],
    phase: str,
    readiness_gates: list[str],
    previous: list[dict[str, Any]],
    now: str,
    initialized: bool = True,
) -> list[dict[str, Any]]:
    prev = {c["type"]: c for c in previous}
    terminal = phase in TERMINAL_PHASES
    unready = [r.name for r in records if not r.ready]
    containers_ready = not unready and not terminal
    reason = "PodCompleted" if terminal else "ContainersNotReady"
    message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    gates_ok = all(prev.get(gate, {}).get("status") == "True" for gate in readiness_gates)
    ready_message = message if not containers_ready else "the status of pod readiness gate(s) is not True"
    return [
        _condition("PodReadyToStartContainers", not terminal, prev, now),
        _condition(
            "Initialized", initialized, prev, now, "ContainersNotInitialized", "init containers have not finished"
        ),
        _condition("ContainersReady", containers_ready, prev, now, reason, message),
        _condition(
            "Ready",
            containers_ready and gates_ok,
            prev,
            now,
            reason if not containers_ready else "ReadinessGatesNotReady",
            ready_message,
        ),
    ]
