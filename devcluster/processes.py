"""Starting and stopping background processes that outlive the command that started them (pidfiles, groups).

A pid is only trusted while its command line still mentions the cluster's state directory: after a reboot or a
crash the number may belong to someone else's process, which `down` must never signal.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from tidal.devcluster.plan import ProcessSpec

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent goes away.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(spec: ProcessSpec, log_file: Path, pidfile: Path, cwd: Path, die_with_parent: bool = False) -> int:
    """Start detached (own session, so the CLI's terminal and Ctrl-C do not reach it); return its pid.

    die_with_parent: for clusters owned by a test session, so a killed pytest leaves no cluster behind.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    pidfile.write_text(f"{proc.pid}\n")
    return proc.pid


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The state letter follows the parenthesised command name, which may itself contain spaces.
    return stat[stat.rfind(")") + 2] == "Z"


def is_ours(pid: int, marker: str) -> bool:
    cmdline = _cmdline(pid)
    return cmdline is not None and marker in cmdline and not _is_zombie(pid)


def alive(pidfile: Path, marker: str) -> int | None:
    pid = read_pid(pidfile)
    return pid if pid is not None and is_ours(pid, marker) else None


def stop(pidfile: Path, marker: str, grace_s: float = 10.0) -> bool:
    """SIGTERM the process group, SIGKILL it after the grace period; True if something was running."""
    pid = alive(pidfile, marker)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and is_ours(pid, marker):
        _reap(pid)
        time.sleep(0.05)
    if is_ours(pid, marker):
        _signal_group(pid, signal.SIGKILL)
        while is_ours(pid, marker):
            _reap(pid)
            time.sleep(0.02)
    _reap(pid)
    pidfile.unlink(missing_ok=True)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # started with start_new_session, so its pid is its group id


def _reap(pid: int) -> None:
    # Only our own children can be reaped; for a process started by an earlier CLI call this is a no-op.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
