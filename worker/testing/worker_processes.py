"""Worker processes (`python -m tidal.worker`) of one expert-parallel group on loopback: start, watch, break, replace.

Each rank runs in its own process, as in a pod, with its own serving, control and group ports and a log file in a
work directory. The ports are picked below the kernel's ephemeral range, so that neither a listener asking for port
0 nor an outgoing connection (the load generator opens many) can take one between the pick and the worker's bind.
Faults are real signals: SIGKILL (a crash), SIGSTOP (a frozen process: its sockets still accept, nothing answers).
A rank can be started again after its process is gone: the replacement is a new process on new ports, as a new pod
would be. The group's size (`group_size`, the launch's world_size at first) is what a resize changes: ranks started
past it for a grown group take a launch of their own (the new world_size, the running members' slot count). Every
process started is ended by `close()` (the context manager's exit), and on Linux also dies with the process that
started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from tidal.contract.control_api import TOKEN_HEADER, WorkerState
from tidal.worker.config import WORKER_OPTIONS
from tidal.worker.testing.in_process import TEST_TOKEN

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class WorkerLaunch:
    """What every rank of the group is started with; `extra_flags` are passed on as they are (`--max-num-seqs 8`)."""

    model_path: Path
    world_size: int
    device: str = "cpu"
    dtype: str = "float32"
    num_kv_blocks: int | None = 256
    redundant_experts_per_rank: int = 0
    expert_slots_per_rank: int | None = None  # None: the worker derives it from world_size and the redundant slots
    group_timeout_s: float | None = None
    host: str = "127.0.0.1"
    token: str = TEST_TOKEN
    log_level: str = "info"
    extra_flags: tuple[str, ...] = ()
    # GPUs: rank r sees only visible_devices[r % len] (CUDA_VISIBLE_DEVICES), as a pod with one GPU would.
    visible_devices: tuple[str, ...] | None = None

    @property
    def model_name(self) -> str:
        """The name requests must carry: `--served-model-name` when given among the extra flags, else the folder's."""
        flags = list(self.extra_flags)
        if "--served-model-name" in flags:
            return flags[flags.index("--served-model-name") + 1]
        return self.model_path.name


@dataclass(frozen=True)
class WorkerPorts:
    serving: int
    control: int
    group: int


@dataclass
class WorkerProcess:
    """One process of one rank. `incarnation` counts the processes started for the rank (0: the first)."""

    rank: int
    incarnation: int
    host: str
    ports: WorkerPorts
    log_path: Path
    popen: subprocess.Popen[bytes]
    started_at: float  # time.monotonic()
    frozen: bool = False
    signals: list[tuple[str, float]] = field(default_factory=list)  # (signal name, monotonic time) sent by us

    @property
    def serving_url(self) -> str:
        return f"http://{self.host}:{self.ports.serving}"

    @property
    def control_url(self) -> str:
        return f"http://{self.host}:{self.ports.control}"

    @property
    def group_address(self) -> str:
        """host:port of the rank's group endpoint, as `/group/reconfigure` members name it."""
        return f"{self.host}:{self.ports.group}"

    @property
    def is_running(self) -> bool:
        """True while the process exists, frozen or not."""
        return self.popen.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self) -> str:
        status = "running" if self.is_running else f"exited with {self.exit_code}"
        if self.frozen and self.is_running:
            status = "frozen (SIGSTOP)"
        return f"rank {self.rank} (incarnation {self.incarnation}, pid {self.popen.pid}, {status})"

    def log_report(self, lines: int = LOG_TAIL_LINES) -> str:
        return f"--- {self.describe()}, log {self.log_path} (last {lines} lines):\n{self.log_tail(lines)}"


class WorkerStartError(RuntimeError):
    """A worker exited or did not load in time; the message ends with the tail of its log."""


class WorkerProcesses:
    """The processes of ranks 0..group_size-1 (one current process per rank; processes of ranks a shrink left out
    are kept until closed); a context manager that ends them all."""

    def __init__(self, launch: WorkerLaunch, workdir: Path | None = None) -> None:
        self.launch = launch
        self.group_size = launch.world_size  # the group's current size: set by a resize
        self._launches: dict[int, WorkerLaunch] = {}  # ranks started with a launch of their own
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="tidal-group-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._current: dict[int, WorkerProcess] = {}
        self.history: list[WorkerProcess] = []  # every process ever started, in order
        self._ports_given: set[int] = set()

    # ----- context -----
    def __enter__(self) -> WorkerProcesses:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:  # the test's failure message is above; the workers' side of the story goes below
            print(self.log_reports(), file=sys.stderr)
        self.close()
        if exc_type is None and self._own_workdir:  # logs stay for a post-mortem only when something failed
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ----- queries -----
    @property
    def ranks(self) -> list[int]:
        return list(range(self.group_size))

    def launch_of(self, rank: int) -> WorkerLaunch:
        """What `rank` is started with: its own launch, when it was given one, else the group's."""
        return self._launches.get(rank, self.launch)

    def __getitem__(self, rank: int) -> WorkerProcess:
        return self._current[rank]

    def __iter__(self) -> Iterator[WorkerProcess]:
        return iter(self._current[rank] for rank in sorted(self._current))

    def serving_url(self, rank: int) -> str:
        """The serving URL of the rank's current process (a replacement's once it was started)."""
        return self._current[rank].serving_url

    def log_reports(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(process.log_report(lines) for process in self.history)

    # ----- starting -----
    def start(self, rank: int, launch: WorkerLaunch | None = None) -> WorkerProcess:
        """Start a process for `rank` (returns at once; `wait_loaded` waits for the model). A replacement needs the
        rank's previous process gone (`kill` or `stop` it first). `launch`: the rank's own from now on (a rank that
        grows the group), kept for its replacements."""
        if launch is not None:
            self._launches[rank] = launch
        world_size = self.launch_of(rank).world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
        previous = self._current.get(rank)
        if previous is not None and previous.is_running:
            raise RuntimeError(f"{previous.describe()} is still running; kill or stop it before replacing it")
        incarnation = 0 if previous is None else previous.incarnation + 1
        ports = WorkerPorts(*(self._pick_port() for _ in range(3)))
        log_path = self.workdir / f"rank{rank}-{incarnation}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "tidal.worker", *self._flags(rank, ports)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(rank),
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        process = WorkerProcess(rank, incarnation, self.launch.host, ports, log_path, popen, time.monotonic())
        self._current[rank] = process
        self.history.append(process)
        return process

    def start_all(self) -> list[WorkerProcess]:
        return [self.start(rank) for rank in self.ranks]

    def _flags(self, rank: int, ports: WorkerPorts) -> list[str]:
        launch = self.launch_of(rank)
        flags = {
            "--model": str(launch.model_path),
            "--device": launch.device,
            "--dtype": launch.dtype,
            "--host": launch.host,
            "--port": str(ports.serving),
            "--control-port": str(ports.control),
            "--group-port": str(ports.group),
            "--rank": str(rank),
            "--world-size": str(launch.world_size),
            "--redundant-experts-per-rank": str(launch.redundant_experts_per_rank),
            "--log-level": launch.log_level,
        }
        if launch.num_kv_blocks is not None:
            flags["--num-kv-blocks"] = str(launch.num_kv_blocks)
        if launch.group_timeout_s is not None:
            flags["--group-timeout-s"] = str(launch.group_timeout_s)
        if launch.expert_slots_per_rank is not None:
            flags["--expert-slots-per-rank"] = str(launch.expert_slots_per_rank)
        return [*(part for pair in flags.items() for part in pair), *launch.extra_flags]

    def _environment(self, rank: int) -> dict[str, str]:
        """This process's environment without any worker setting (a stray TIDAL_PORT or TIDAL_CONTROL_TOKEN_FILE
        would change or break the workers), plus the control token, which a flag would show in `ps`."""
        worker_names = {name for option in WORKER_OPTIONS.options.values() for name in option.env_names}
        env = {name: value for name, value in os.environ.items() if name not in worker_names}
        env["TIDAL_CONTROL_TOKEN"] = self.launch.token
        env["PYTHONUNBUFFERED"] = "1"  # the log shows what happened up to a SIGKILL
        devices = self.launch_of(rank).visible_devices
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
        return env

    def _pick_port(self) -> int:
        low, high = _unclaimed_port_range()
        for _ in range(200):
            port = random.randrange(low, high)
            if port not in self._ports_given and _is_free(self.launch.host, port):
                self._ports_given.add(port)
                return port
        raise RuntimeError(f"found no free port on {self.launch.host} in {low}..{high - 1}")

    # ----- waiting -----
    async def wait_loaded(self, rank: int, timeout_s: float = 120.0) -> WorkerState:
        """The rank's `/state` once it says `model_loaded`. WorkerStartError (with the log's tail) if the process
        exits first or the time runs out."""
        process = self._current[rank]
        deadline = time.monotonic() + timeout_s
        headers = {TOKEN_HEADER: f"Bearer {self.launch.token}"}
        last_error = "no answer yet"
        async with httpx.AsyncClient(base_url=process.control_url, headers=headers, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not process.is_running:
                    raise WorkerStartError(f"{process.describe()} exited while loading\n{process.log_report()}")
                try:
                    response = await client.get("/state")
                    if response.status_code == 200:
                        state = WorkerState.model_validate(response.json())
                        if state.model_loaded:
                            return state
                        last_error = "model_loaded is false"
                    else:
                        last_error = f"/state answered {response.status_code}: {response.text[:200]}"
                except httpx.TransportError as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.1)
        raise WorkerStartError(
            f"{process.describe()} did not report model_loaded within {timeout_s:g}s (last: {last_error})\n"
            f"{process.log_report()}"
        )

    async def wait_all_loaded(self, timeout_s: float = 120.0) -> dict[int, WorkerState]:
        states = await asyncio.gather(*(self.wait_loaded(rank, timeout_s) for rank in sorted(self._current)))
        return dict(zip(sorted(self._current), states, strict=True))

    # ----- faults and ends -----
    def kill(self, rank: int) -> float:
        """SIGKILL the rank's process and reap it; -> the monotonic time of the signal."""
        process = self._current[rank]
        at = self._signal(process, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=10)
        return at

    def freeze(self, rank: int) -> float:
        """SIGSTOP the rank's process: it keeps its sockets (connections are accepted) and answers nothing."""
        process = self._current[rank]
        at = self._signal(process, signal.SIGSTOP)
        process.frozen = True
        return at

    def thaw(self, rank: int) -> float:
        process = self._current[rank]
        at = self._signal(process, signal.SIGCONT)
        process.frozen = False
        return at

    def stop(self, rank: int, grace_s: float = 10.0) -> int | None:
        """SIGTERM (after thawing a frozen process), SIGKILL after `grace_s`; -> the exit code."""
        return _end(self._current[rank], grace_s)

    def replace(self, rank: int) -> WorkerProcess:
        """End the rank's process if it still runs (SIGKILL, as an operator deleting a pod), start a new one."""
        if self._current[rank].is_running:
            self.kill(rank)
        return self.start(rank)

    def close(self, grace_s: float = 5.0) -> None:
        """End every process ever started here (SIGTERM, then SIGKILL after `grace_s`)."""
        running = [p for p in self.history if p.is_running]
        for process in running:
            if process.frozen:
                process.popen.kill()  # a stopped process handles no SIGTERM
            else:
                process.popen.terminate()
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()

    @staticmethod
    def _signal(process: WorkerProcess, sig: signal.Signals) -> float:
        if not process.is_running:
            raise RuntimeError(f"cannot send {sig.name}: {process.describe()}")
        at = time.monotonic()
        process.popen.send_signal(sig)
        process.signals.append((sig.name, at))
        return at


def _end(process: WorkerProcess, grace_s: float) -> int | None:
    if not process.is_running:
        return process.exit_code
    if process.frozen:
        process.popen.send_signal(signal.SIGCONT)
        process.frozen = False
    process.popen.terminate()
    try:
        return process.popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.popen.kill()
        return process.popen.wait()


def _unclaimed_port_range() -> tuple[int, int]:
    """[low, high): ports below the ephemeral range, which only an explicit bind takes."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    high = ephemeral_low
    low = max(10000, high - 16000)
    if high - low < 1000:  # an unusual kernel setting: take any high port and rely on the bind check
        return 40000, 65000
    return low, high


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the workers' servers bind
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL it when the harness dies, so no worker outlives a crashed test.
    The kernel ties this to the starting *thread*: start workers from a thread that lives as long as they do."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
