"""One run of one container: a local process group with its log file and pidfile (the node agent's "runtime").

Each container runs in its own session (process group), so signals reach everything it started, and when its
main process exits the rest of the group is killed, as a container runtime tears down a container's cgroup.
"""

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid it names one process unambiguously."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat[stat.rfind(")") + 2] == "Z"


def exit_code_of(returncode: int) -> int:
    # Popen reports death by signal N as -N; container runtimes report 128 + N (SIGKILL -> 137).
    return 128 - returncode if returncode < 0 else returncode


class ContainerProcess:
    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        log_path: Path,
        pidfile: Path,
        on_exit: Callable[[], None],
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self._proc.pid
        self.pidfile = pidfile
        pidfile.write_text(f"{self.pid} {_start_time(self.pid) or ''}\n")
        self.exit_code: int | None = None
        self._on_exit = on_exit
        threading.Thread(target=self._wait, name=f"wait-{self.pid}", daemon=True).start()

    def _wait(self) -> None:
        returncode = self._proc.wait()
        # Whatever the main process left behind in its group goes with it.
        self.signal(signal.SIGKILL)
        self.exit_code = exit_code_of(returncode)
        self.pidfile.unlink(missing_ok=True)
        self._on_exit()

    @property
    def exited(self) -> bool:
        return self.exit_code is not None

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)
        # A frozen (SIGSTOPped) process could not act on SIGTERM; let it, so it can still stop gracefully.
        self.signal(signal.SIGCONT)


def kill_orphan(pidfile: Path) -> bool:
    """Kill the group recorded by an earlier agent (if it is still that very process); True if one was killed."""
    try:
        pid_text, _, started = pidfile.read_text().strip().partition(" ")
        pid = int(pid_text)
    except (FileNotFoundError, ValueError):
        return False
    killed = False
    if started and _start_time(pid) == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            killed = True
        # Not our child, so no wait(): watch /proc until it is gone (or a zombie), so that what it held (its
        # port above all) is free before the container starts again.
        deadline = time.monotonic() + 5.0
        while _start_time(pid) == started and not _is_zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    pidfile.unlink(missing_ok=True)
    return killed


def signal_from_pidfile(pidfile: Path, sig: signal.Signals) -> int:
    """Signal a running container's group by its pidfile (fault injection from outside the agent); the pid."""
    try:
        pid_text, _, started = pidfile.read_text().strip().partition(" ")
        pid = int(pid_text)
    except (FileNotFoundError, ValueError) as exc:
        raise LookupError(f"no running container process recorded in {pidfile}") from exc
    if started and _start_time(pid) != started:
        raise LookupError(f"the process recorded in {pidfile} is gone")
    os.killpg(pid, sig)
    return pid
