"""One thread per pod bound to the node: level-based reconcile of the pod's processes and its status.

It wakes when the watch delivers a newer pod, when a container process exits, and when a timer it asked for
(probe period, back-off, grace deadline, retry) comes due; never on a fixed poll.
"""

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from tidal.devcluster.nodeagent.allocators import AddressPool, GpuPool, gpu_request
from tidal.devcluster.nodeagent.config import AgentConfig
from tidal.devcluster.nodeagent.container import NEVER, ContainerSlot
from tidal.devcluster.nodeagent.envresolve import EnvContext, EnvError
from tidal.devcluster.nodeagent.faults import FAULT_ANNOTATION, SIGNALS, parse_fault
from tidal.devcluster.nodeagent.identity import PodIdentity, wants_token
from tidal.devcluster.nodeagent.kubeapi import NodeApi
from tidal.devcluster.nodeagent.launch import NO_COMMAND, plan_launch
from tidal.devcluster.nodeagent.layout import PodDirs
from tidal.devcluster.nodeagent.lifecycle import (
    TERMINAL_PHASES,
    ContainerRecord,
    carry_over,
    now_iso,
    terminated_state,
)
from tidal.devcluster.nodeagent.node import HOST_IP
from tidal.devcluster.nodeagent.podstatus import PodView, compose_status, same_status
from tidal.devcluster.nodeagent.runtime import kill_orphan

log = logging.getLogger(__name__)
API_ERRORS = (ApiException, HTTPError, OSError)


@dataclass(frozen=True)
class NodeContext:
    """What every pod worker shares: the API, the config, the node's pools and the cluster CA."""

    api: NodeApi
    cfg: AgentConfig
    addresses: AddressPool
    gpus: GpuPool
    ca_pem: bytes
    allocatable: dict[str, str]


class PodWorker(threading.Thread):
    def __init__(self, ctx: NodeContext, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.ctx = ctx
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self._pod = pod
        self._gone = False  # deleted from the API by someone else (force delete) or the agent is stopping
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.dirs = PodDirs.of(ctx.cfg.state_dir, meta["namespace"], meta["name"], self.uid)
        self._init_slots: list[ContainerSlot] = []
        self._slots: list[ContainerSlot] = []
        self._pod_ip = ""
        self._gpu_ids: list[int] = []
        self._identity = PodIdentity(ctx.api, ctx.ca_pem, self.dirs.kubeconfig, ctx.cfg.token_seconds)
        self._terminal = pod.get("status", {}).get("phase") in TERMINAL_PHASES
        self._kill_at: float | None = None
        self._last_status: dict[str, Any] | None = None
        self._start_time = pod.get("status", {}).get("startTime") or now_iso()
        self._applied_faults: set[str] = set()
        self._stopping = False  # the agent is shutting down: start nothing new
        # Held while a process starts and while shutdown sets _stopping, so shutdown sees every process started.
        self._start_lock = threading.Lock()

    # -- inputs from other threads -----------------------------------------------------------------------------
    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        with self._lock:
            self._gone = True
        self._wake.set()

    def _poke(self) -> None:
        self._wake.set()

    def _event(self, event_type: str, reason: str, message: str) -> None:
        # Events are for people reading `kubectl describe`; losing one must not stop the pod's reconcile.
        try:
            self.ctx.api.record_event(self._pod, event_type, reason, message, self.ctx.cfg.node_name)
        except API_ERRORS as exc:
            log.warning("%s: could not record event %s: %s", self.key, reason, exc)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            while not self.done.is_set():
                self._wake.clear()
                try:
                    wake_at = self._reconcile(time.monotonic())
                except API_ERRORS as exc:
                    log.warning("%s: API call failed, retrying: %s", self.key, exc)
                    wake_at = time.monotonic() + 1.0
                if not self.done.is_set():
                    self._wake.wait(timeout=max(0.0, min(wake_at - time.monotonic(), 30.0)))
        except Exception:
            log.exception("%s: pod worker crashed", self.key)
            self._kill_everything()
            self.done.set()

    def _setup(self) -> None:
        self.dirs.root.mkdir(parents=True, exist_ok=True)
        self.dirs.workdir.mkdir(exist_ok=True)
        for pidfile in self.dirs.root.glob("*.pid"):
            if kill_orphan(pidfile):
                log.info("%s: killed a process left by an earlier node agent (%s)", self.key, pidfile.name)
        if self.dirs.applied_faults.exists():
            self._applied_faults = set(self.dirs.applied_faults.read_text().split())
        pod = self._pod
        status = pod.get("status", {})
        policy = pod["spec"].get("restartPolicy", "Always")
        # Init containers run to completion one after another; a failed one is retried unless the pod says Never.
        init_policy = "Never" if policy == "Never" else "OnFailure"
        previous_init = {s["name"]: s for s in status.get("initContainerStatuses", [])}
        for container in pod["spec"].get("initContainers", []):
            self._init_slots.append(self._make_slot(pod, container, init_policy, previous_init.get(container["name"])))
        already_initialized = any(
            c["type"] == "Initialized" and c["status"] == "True" for c in status.get("conditions", [])
        )
        if already_initialized:  # an earlier agent finished them; do not run them again
            for slot in self._init_slots:
                slot.record.state = terminated_state(0, self._start_time, self._start_time)
                slot.record.ready, slot.next_start = True, NEVER
        previous = {s["name"]: s for s in status.get("containerStatuses", [])}
        for container in pod["spec"]["containers"]:
            slot = self._make_slot(pod, container, policy, previous.get(container["name"]))
            if self._init_slots and not already_initialized:
                slot.record.state = {"waiting": {"reason": "PodInitializing"}}
            self._slots.append(slot)

    def _make_slot(
        self, pod: dict[str, Any], container: dict[str, Any], restart_policy: str, previous: dict[str, Any] | None
    ) -> ContainerSlot:
        record = ContainerRecord(container["name"], container.get("image", ""))
        cfg = self.ctx.cfg
        slot = ContainerSlot(
            spec=container,
            record=record,
            log_path=self.dirs.log(container["name"]),
            previous_log_path=self.dirs.previous_log(container["name"]),
            pidfile=self.dirs.pidfile(container["name"]),
            termination_log_path=self.dirs.termination_log(container["name"]),
            pod_ip="",
            restart_policy=restart_policy,
            kill_grace_s=float(pod["spec"].get("terminationGracePeriodSeconds", 30)),
            on_exit=self._poke,
            backoff=(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_reset_s),
            on_event=self._event,
        )
        if previous is not None:  # the agent restarted
            carry_over(record, previous, self._start_time)
        return slot

    def _reconcile(self, now: float) -> float:
        with self._lock:
            pod, gone = self._pod, self._gone
        if gone or pod["metadata"].get("deletionTimestamp"):
            return self._terminate(pod, now, delete_from_api=not gone)
        if self._terminal or self._stopping:
            return NEVER
        if not self._pod_ip:
            try:
                self._assign_resources(pod)
            except RuntimeError as exc:  # no address or not enough GPUs left: the kubelet rejects such a pod
                self._reject(pod, "UnexpectedAdmissionError", str(exc))
                return NEVER
        if self._identity.path.exists():
            self._identity.ensure(pod, now)  # refreshes the token at 80% of its life, else a no-op
        self._apply_fault(pod)
        initialized = self._step_init(pod, now)
        if initialized:
            for slot in self._slots:
                slot.step(now)
                if slot.wants_start(now) and not self._stopping:
                    self._start(slot, pod, now)
        self._report(pod, initialized)
        slots = self._slots if initialized else self._init_slots
        return min([slot.next_wake() for slot in slots] + [self._identity.refresh_at or NEVER])

    def _step_init(self, pod: dict[str, Any], now: float) -> bool:
        """Advance the init containers in order; True once every one has exited 0."""
        for slot in self._init_slots:
            if slot.has_succeeded():
                continue
            slot.step(now)
            if slot.has_succeeded():
                slot.record.ready = True  # the kubelet reports a completed init container as ready
                continue
            if slot.wants_start(now) and not self._stopping:
                self._start(slot, pod, now)
            return False
        return True

    @property
    def _all_slots(self) -> list[ContainerSlot]:
        return self._init_slots + self._slots

    def _assign_resources(self, pod: dict[str, Any]) -> None:
        if pod["spec"].get("hostNetwork"):
            self._pod_ip = HOST_IP  # the node's own address, as for host-network pods on any node
        else:
            self._pod_ip = self.ctx.addresses.assign(self.uid, pod.get("status", {}).get("podIP"))
        for slot in self._all_slots:
            slot.pod_ip = self._pod_ip
        self._gpu_ids = self.ctx.gpus.assign(self.uid, gpu_request(pod))

    def _start(self, slot: ContainerSlot, pod: dict[str, Any], now: float) -> None:
        kubeconfig = None
        if wants_token(pod):
            try:
                self._identity.ensure(pod, now)
            except API_ERRORS as exc:
                slot.hold("CreateContainerConfigError", f"no ServiceAccount token yet: {exc}", 1.0, now)
                return
            kubeconfig = self.dirs.kubeconfig
        api = self.ctx.api
        env_ctx = EnvContext(api.secret_data, api.config_map_data, self._pod_ip, HOST_IP, self.ctx.allocatable)
        try:
            plan = plan_launch(
                pod, slot.spec, env_ctx, self._gpu_ids, kubeconfig, self.dirs.workdir, slot.termination_log_path
            )
        except (EnvError, ApiException) as exc:
            message = str(exc) if isinstance(exc, EnvError) else f"API error {exc.status}: {exc.reason}"
            # Nothing will change a pod without a command (its spec is immutable): retry rarely.
            slot.hold("CreateContainerConfigError", message, 30.0 if message == NO_COMMAND else 2.0, now)
            return
        with self._start_lock:
            if self._stopping:  # shutdown began while the environment was resolved
                return
            slot.start(plan, now)

    def _apply_fault(self, pod: dict[str, Any]) -> None:
        value = pod["metadata"].get("annotations", {}).get(FAULT_ANNOTATION)
        if not value or value in self._applied_faults:
            return
        self._applied_faults.add(value)
        self.dirs.applied_faults.write_text("\n".join(sorted(self._applied_faults)) + "\n")
        try:
            sig = SIGNALS[parse_fault(value)]
        except ValueError as exc:
            log.warning("%s: ignoring fault annotation: %s", self.key, exc)
            return
        for slot in self._all_slots:
            if slot.process is not None:
                log.info("%s: injecting fault %s into %s", self.key, value, slot.name)
                slot.process.signal(sig)

    def _report(self, pod: dict[str, Any], initialized: bool) -> None:
        view = PodView(
            init_records=[slot.record for slot in self._init_slots],
            records=[slot.record for slot in self._slots],
            initialized=initialized,
            init_failed=any(slot.next_start == NEVER and not slot.has_succeeded() for slot in self._init_slots),
            pod_ip=self._pod_ip,
            start_time=self._start_time,
        )
        status = compose_status(pod, view)
        if same_status(status, self._last_status):
            return
        self.ctx.api.patch_pod_status(pod["metadata"]["namespace"], pod["metadata"]["name"], status)
        self._last_status = status
        if status["phase"] in TERMINAL_PHASES:
            log.info("%s: %s", self.key, status["phase"])
            self._terminal = True
            self._release()

    def _reject(self, pod: dict[str, Any], reason: str, message: str) -> None:
        log.warning("%s: rejected: %s", self.key, message)
        self._event("Warning", reason, message)
        status = {"phase": "Failed", "reason": reason, "message": message, "startTime": self._start_time}
        self.ctx.api.patch_pod_status(pod["metadata"]["namespace"], pod["metadata"]["name"], status)
        self._terminal = True
        self._release()

    # -- stopping ----------------------------------------------------------------------------------------------
    def _terminate(self, pod: dict[str, Any], now: float, delete_from_api: bool) -> float:
        running = [s for s in self._all_slots if s.process is not None and not s.process.exited]
        if self._kill_at is None:
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            if not delete_from_api:
                grace = min(float(grace), 5.0)
            self._kill_at = now + float(grace)
            for slot in self._all_slots:
                slot.next_start = NEVER
            for slot in running:
                if delete_from_api:
                    self._event("Normal", "Killing", f"Stopping container {slot.name}")
                slot.process.terminate()  # type: ignore[union-attr]
        if running:
            if now >= self._kill_at:
                for slot in running:
                    slot.process.signal(signal.SIGKILL)  # type: ignore[union-attr]
                return now + 0.1
            return self._kill_at
        self._release()
        if delete_from_api:
            meta = pod["metadata"]
            self.ctx.api.delete_pod_now(meta["namespace"], meta["name"], self.uid)
            log.info("%s: stopped and deleted", self.key)
        self.done.set()
        return NEVER

    def _release(self) -> None:
        self.ctx.addresses.release(self.uid)
        self.ctx.gpus.release(self.uid)

    def _kill_everything(self) -> None:
        for slot in self._all_slots:
            if slot.process is not None:
                slot.process.signal(signal.SIGKILL)

    def stop_for_shutdown(self, grace_s: float) -> None:
        """The agent is exiting: stop this pod's processes (SIGTERM, SIGKILL after grace_s) without API calls."""
        with self._start_lock:
            self._stopping = True
        procs = [s.process for s in self._all_slots if s.process is not None and not s.process.exited]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + grace_s
        while any(not p.exited for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._kill_everything()
        self.done.set()
        self._wake.set()
