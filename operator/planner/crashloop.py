"""Crash loops: which rank pods are in one, and the Degraded reason and message that say so.

Level-based, from what the pods report and the Degraded condition the last pass wrote (the status is the memory, so
an operator restart forgets nothing). A pod enters a crash loop when it is seen backing off (CrashLoopBackOff) or
ended with an error; it stays in it, across every back-off cycle, until its container has run ready for SETTLE_S
(counted from its current run's startedAt and the pod's Ready time). Degraded therefore flips once when a loop starts
and once when it ends; a cycle only updates the message (the restart count and the container's last termination
message: what the worker wrote before it died, or the tail of its log).

A single crash that the kubelet restarts at once (no back-off) is not a loop: nothing here sees it.
"""

from collections.abc import Sequence
from datetime import datetime

from tidal.operator.api.status import Condition
from tidal.operator.planner.observed import ObservedPod

CRASH_LOOP = "CrashLoop"
# How long a restarted container must run ready before its loop counts as over: a crash within this long of turning
# ready belongs to the same loop. (The node agent resets its back-off after 60 s of running too; the kubelet after
# 10 minutes.)
SETTLE_S = 60.0
# A message names this many pods and counts the rest (a model of 64 x 64 ranks can crash whole).
NAMED_PODS = 5
# The kubelet reads at most 4 KiB of a termination message; a condition quotes no more than that.
QUOTED_CHARS = 4096


def healthy_for_s(pod: ObservedPod, now: datetime) -> float:
    """Seconds the container has run and been ready without a break (0 unless it is both now)."""
    if not pod.ready or pod.started_at is None or pod.terminated:
        return 0.0
    since = pod.started_at if pod.ready_since is None else max(pod.started_at, pod.ready_since)
    return max(0.0, (now - since).total_seconds())


def crashing(pod: ObservedPod) -> bool:
    """Seen crashing now: backing off before a restart, or ended with an error after crashing before. A first crash,
    which the kubelet restarts at once, can be seen ended for a moment; that alone is not a loop."""
    ended_badly = pod.terminated and pod.last_exit_code not in (None, 0)
    return pod.crash_looping or (ended_badly and pod.restart_count > 0)


def failing(pod: ObservedPod, degraded: Condition | None) -> bool:
    """In a crash loop and not serving: crashing now, or, while the last pass saw a loop (`degraded`), restarted
    and not ready since (between two crashes of the loop, as far as anyone can tell)."""
    return crashing(pod) or (in_crash_loop(degraded) and pod.restart_count > 0 and not pod.ready)


def recovering(pod: ObservedPod, now: datetime) -> bool:
    """Restarted and not yet run ready for SETTLE_S: a loop it was in goes on."""
    return pod.restart_count > 0 and healthy_for_s(pod, now) < SETTLE_S


def in_crash_loop(degraded: Condition | None) -> bool:
    return degraded is not None and degraded.status == "True" and degraded.reason == CRASH_LOOP


def last_exit(pod: ObservedPod) -> str:
    """`last exit code 2 (Error): <termination message>`, as much of it as the pod reports ("" for nothing)."""
    code = f" code {pod.last_exit_code}" if pod.last_exit_code is not None else ""
    reason = f" ({pod.last_exit_reason})" if pod.last_exit_reason else ""
    message = (pod.last_exit_message or "").strip()
    if len(message) > QUOTED_CHARS:
        message = message[: QUOTED_CHARS - 1] + "…"
    if not (code or reason or message):
        return ""
    return f"last exit{code}{reason}" + (f": {message}" if message else "")


def crash_loop(pods: Sequence[ObservedPod], degraded: Condition | None, now: datetime) -> tuple[str, str] | None:
    """(reason, message) while a pod is in a crash loop, else None. `degraded`: the condition the last pass wrote."""
    held = in_crash_loop(degraded)
    looping = [p for p in pods if not p.terminating and (crashing(p) or (held and recovering(p, now)))]
    if not looping:
        return None
    # The one quoted: a pod crashing now over one running again, then the one that restarted most.
    worst = max(looping, key=lambda p: (crashing(p), p.restart_count))
    names = ", ".join(p.name for p in looping[:NAMED_PODS])
    if len(looping) > NAMED_PODS:
        names += f" and {len(looping) - NAMED_PODS} more"
    verb = "keeps" if len(looping) == 1 else "keep"
    exit_text = last_exit(worst)
    times = "time" if worst.restart_count == 1 else "times"
    detail = f"{worst.name} restarted {worst.restart_count} {times}" + (f"; {exit_text}" if exit_text else "")
    return CRASH_LOOP, f"{names} {verb} crashing ({detail})"
