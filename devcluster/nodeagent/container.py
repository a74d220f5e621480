"""One container of a pod across its runs: start, notice exits, restart with back-off, probe, kill.

`ContainerSlot.step` is level-based: given "now" it moves the container toward what its spec and the pod's
restartPolicy want, and reports when it next needs attention.
"""

import logging
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.devcluster.nodeagent.lifecycle import (
    ContainerRecord,
    backoff_delay,
    now_iso,
    should_restart,
    terminated_state,
)
from tidal.devcluster.nodeagent.probes import ProbeSpec, ProbeTracker, run_probe
from tidal.devcluster.nodeagent.runtime import ContainerProcess
from tidal.devcluster.nodeagent.termination import empty, termination_message

log = logging.getLogger(__name__)

NEVER = float("inf")
# (type, reason, message) of a Kubernetes Event about the pod, as the kubelet records them.
EventSink = Callable[[str, str, str], None]


def _no_events(kind: str, reason: str, message: str) -> None:
    return None


PROBE_KINDS = ("startup", "liveness", "readiness")


@dataclass
class LaunchPlan:
    """How to run the container now (resolved by the pod worker: env lookups, identity, addresses)."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass
class ContainerSlot:
    spec: dict[str, Any]
    record: ContainerRecord
    log_path: Path
    previous_log_path: Path
    pidfile: Path
    termination_log_path: Path  # stands in for the container's terminationMessagePath (termination.py)
    pod_ip: str
    restart_policy: str
    kill_grace_s: float
    on_exit: Callable[[], None]
    backoff: tuple[float, float, float]  # initial, max, reset-after (seconds)
    process: ContainerProcess | None = None
    started_mono: float = 0.0
    next_start: float = 0.0  # monotonic time of the next (re)start; NEVER once the container is done
    crash_streak: int = 0
    kill_deadline: float | None = None
    killed_by_probe: bool = False
    retry_at: float = 0.0
    probes: dict[str, ProbeTracker] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    on_event: EventSink = _no_events

    @property
    def name(self) -> str:
        name: str = self.spec["name"]
        return name

    @property
    def has_run(self) -> bool:
        return self.process is not None or "terminated" in self.record.state or bool(self.record.last_state)

    def has_succeeded(self) -> bool:
        """Ran to completion with exit code 0 and will not run again (what an init container must do). A method, not
        a property: step() changes the answer, and a checker would otherwise carry an earlier answer across it."""
        return self.next_start == NEVER and self.record.state.get("terminated", {}).get("exitCode") == 0

    def wants_start(self, now: float) -> bool:
        return self.process is None and now >= self.next_start and now >= self.retry_at

    # -- starting ----------------------------------------------------------------------------------------------
    def hold(self, reason: str, message: str, retry_in_s: float, now: float) -> None:
        """Not startable yet (missing Secret, no token yet, ...): say why in the status and retry later."""
        if self.record.state.get("waiting", {}).get("message") != message:
            self.on_event("Warning", "Failed", f"Error: {message}")
        self.record.state = {"waiting": {"reason": reason, "message": message}}
        self.retry_at = now + retry_in_s

    def start(self, plan: LaunchPlan, now: float) -> None:
        is_restart = self.has_run
        if is_restart and self.log_path.exists():
            shutil.move(self.log_path, self.previous_log_path)
        try:
            if not plan.cwd.is_dir():
                raise FileNotFoundError(f"workingDir {plan.cwd} does not exist on this host")
            empty(self.termination_log_path)
            self.process = ContainerProcess(plan.argv, plan.env, plan.cwd, self.log_path, self.pidfile, self.on_exit)
        except OSError as exc:
            # What a runtime reports when the entrypoint cannot be executed; restartPolicy then applies as usual.
            stamp = now_iso()
            self.on_event("Warning", "Failed", f"Error: failed to start container {self.name!r}: {exc}")
            self._finish_run(terminated_state(128, stamp, stamp, f"{exc}", "StartError"), now, now)
            return
        if is_restart:
            self.record.restart_count += 1
        self.env = plan.env
        self.started_mono = now
        self.record.state = {"running": {"startedAt": now_iso()}}
        self.record.container_id = f"tidal://{self.process.pid}"
        self.kill_deadline, self.killed_by_probe = None, False
        self.probes = {}
        for kind in PROBE_KINDS:
            spec = ProbeSpec.from_container(self.spec, kind)
            if spec is not None:
                self.probes[kind] = ProbeTracker(spec, now)
        self.record.started = "startup" not in self.probes
        self.record.ready = "readiness" not in self.probes and self.record.started
        log.info("started %s (pid %d): %s", self.name, self.process.pid, plan.argv)
        self.on_event("Normal", "Started", f"Started container {self.name}")

    # -- running -----------------------------------------------------------------------------------------------
    def step(self, now: float) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.exited:
            started = self.record.state.get("running", {}).get("startedAt", now_iso())
            code = int(proc.exit_code or 0)
            self.process = None
            message = termination_message(self.spec, self.termination_log_path, self.log_path, code)
            self._finish_run(terminated_state(code, started, now_iso(), message), now, self.started_mono)
            return
        if self.kill_deadline is not None:
            if now >= self.kill_deadline:
                proc.signal(signal.SIGKILL)
            return
        self._probe(now)

    def _probe(self, now: float) -> None:
        startup = self.probes.get("startup")
        if startup is not None and not self.record.started:
            if self._run_probe(startup, now):
                self.record.started = True
            elif startup.failed:
                self.kill("startup", now)
            return
        liveness = self.probes.get("liveness")
        if liveness is not None and not self._run_probe(liveness, now) and liveness.failed:
            self.kill("liveness", now)
            return
        readiness = self.probes.get("readiness")
        if readiness is not None:
            self._run_probe(readiness, now)
            self.record.ready = readiness.succeeded
        else:
            self.record.ready = True

    def _run_probe(self, tracker: ProbeTracker, now: float) -> bool:
        """Probe if due; True while the probe's threshold of successes holds."""
        if tracker.due(now):
            ok, message = run_probe(tracker.spec, self.spec, self.pod_ip, self.env)
            tracker.record(ok, message, time.monotonic())
            # One event when a failure streak starts and one when it crosses the threshold, not one per period.
            if not ok and tracker.failures in (1, tracker.spec.failure_threshold):
                self.on_event("Warning", "Unhealthy", f"{tracker.spec.kind.capitalize()} probe failed: {message}")
        return tracker.succeeded

    def kill(self, failed_probe: str, now: float) -> None:
        """SIGTERM now, SIGKILL at the grace deadline (non-blocking; `step` finishes it)."""
        if self.process is None or self.kill_deadline is not None:
            return
        why = f"Container {self.name} failed {failed_probe} probe, will be restarted"
        log.info("killing: %s", why)
        self.on_event("Normal", "Killing", why)
        self.killed_by_probe = True
        self.record.ready = False
        self.process.terminate()
        self.kill_deadline = now + self.kill_grace_s

    def _finish_run(self, terminated: dict[str, Any], now: float, started_mono: float) -> None:
        self.record.ready = False
        self.record.started = False
        self.probes = {}
        exit_code = int(terminated["terminated"]["exitCode"])
        # A container killed for failing its probe is restarted even if it exited 0 on SIGTERM (unless Never).
        restart = should_restart(self.restart_policy, exit_code) or (
            self.killed_by_probe and self.restart_policy != "Never"
        )
        if not restart:
            self.record.state = terminated
            self.next_start = NEVER
            return
        initial, maximum, reset_after = self.backoff
        self.crash_streak = 1 if now - started_mono >= reset_after else self.crash_streak + 1
        # As the kubelet: the first crash of a streak restarts at once, each later one after a doubling back-off.
        # Backing off the first too made every single crash look like a loop (CrashLoopBackOff) to the operator.
        delay = backoff_delay(self.crash_streak - 1, initial, maximum)
        self.record.last_state = terminated
        self.next_start = now + delay
        if delay <= 0:
            self.record.state = terminated  # until the new run starts, as the kubelet reports the dead container
            return
        self.record.state = {
            "waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {delay:g}s restarting failed container"}
        }
        self.on_event("Warning", "BackOff", f"Back-off restarting failed container {self.name}")

    def next_wake(self) -> float:
        if self.process is None:
            return max(self.next_start, self.retry_at)
        if self.kill_deadline is not None:
            return self.kill_deadline
        return min((p.next_due for p in self.probes.values()), default=NEVER)
