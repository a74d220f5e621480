"""Fault injection for tests: crash (SIGKILL), freeze (SIGSTOP) or thaw (SIGCONT) a pod's processes.

Two ways in: directly by pidfile from the same machine (`inject_local`, synchronous), or declaratively with the
annotation `devcluster.tidal.dev/fault: <action>[/<nonce>]`, which the node agent applies once per distinct value
(`request_fault` sets it with a fresh nonce, so the same action can be asked for again).
"""

import signal
import uuid
from pathlib import Path

from tidal.devcluster.nodeagent.layout import PodDirs
from tidal.devcluster.nodeagent.runtime import signal_from_pidfile

FAULT_ANNOTATION = "devcluster.tidal.dev/fault"
SIGNALS = {"crash": signal.SIGKILL, "freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}


def parse_fault(value: str) -> str:
    """The action of an annotation value; ValueError for an unknown one."""
    action = value.split("/", 1)[0].strip()
    if action not in SIGNALS:
        raise ValueError(f"unknown fault {action!r}; expected one of {sorted(SIGNALS)}")
    return action


def inject_local(pods_dir: Path, namespace: str, name: str, action: str, container: str | None = None) -> list[int]:
    """Signal the pod's running container processes now; returns the pids signalled."""
    sig = SIGNALS[parse_fault(action)]
    dirs = PodDirs.newest(pods_dir, namespace, name)
    pidfiles = [dirs.pidfile(container)] if container else sorted(dirs.root.glob("*.pid"))
    pids = [signal_from_pidfile(p, sig) for p in pidfiles]
    if not pids:
        raise LookupError(f"pod {namespace}/{name} has no running container processes under {dirs.root}")
    return pids


def request_fault(core_api: object, namespace: str, name: str, action: str) -> str:
    """Ask the node agent (through the API server) to apply a fault; returns the annotation value set."""
    value = f"{parse_fault(action)}/{uuid.uuid4().hex[:8]}"
    core_api.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {FAULT_ANNOTATION: value}}})  # type: ignore[attr-defined]
    return value
