"""Termination messages, as the kubelet makes them: a container's last words in `state.terminated.message`.

The kubelet mounts a file of its own over each container's `terminationMessagePath` (default `/dev/termination-log`)
and, when the container ends, reads it: at most its last 4 KiB. With `terminationMessagePolicy:
FallbackToLogsOnError`, a container that ended with an error and left the file empty gets the end of its log
instead: its last 80 lines, at most 2 KiB.

A process of the node agent shares the host's file system, so nothing can be mounted at that path. Each container
gets a file of its own beside its log (`<container>.termination-log`), emptied before every start, and, standing in
for the mount, every variable of the container's environment whose value is exactly its terminationMessagePath holds
that file's path instead (Tidal's pod builder tells the worker the path in `TIDAL_TERMINATION_MESSAGE_PATH`). A
program that writes to the literal path without being told it cannot write there.
"""

from pathlib import Path
from typing import Any

DEFAULT_PATH = "/dev/termination-log"
FALLBACK_TO_LOGS = "FallbackToLogsOnError"
# The kubelet's limits: what it reads of the file, and of the log on the fallback.
MAX_FILE_BYTES = 4096
MAX_LOG_LINES = 80
MAX_LOG_BYTES = 2048


def message_path(container: dict[str, Any]) -> str:
    """The path the container was told (the API server fills in the default; a bare spec in a test may not)."""
    path: str = container.get("terminationMessagePath") or DEFAULT_PATH
    return path


def map_to_host_file(env: dict[str, str], container: dict[str, Any], host_file: Path) -> dict[str, str]:
    """The container's environment with its terminationMessagePath pointing at the file the agent reads."""
    path = message_path(container)
    return {name: str(host_file) if value == path else value for name, value in env.items()}


def empty(host_file: Path) -> None:
    """A fresh, empty file for the next run (a message of an earlier run must not be read as this one's)."""
    host_file.parent.mkdir(parents=True, exist_ok=True)
    host_file.write_bytes(b"")


def _tail(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - limit))
        return f.read()


def _decode(data: bytes) -> str:
    # The cut may fall inside a character; the API server would replace the broken bytes the same way.
    return data.decode("utf-8", errors="replace")


def log_tail(log_path: Path) -> str:
    """The last MAX_LOG_LINES lines of a log, at most MAX_LOG_BYTES ("" without a log)."""
    try:
        data = _tail(log_path, MAX_LOG_BYTES)
    except FileNotFoundError:
        return ""
    return _decode(b"".join(data.splitlines(keepends=True)[-MAX_LOG_LINES:]))


def termination_message(container: dict[str, Any], host_file: Path, log_path: Path, exit_code: int) -> str:
    """What the container's terminated state says about its end ("" for nothing)."""
    fallback = container.get("terminationMessagePolicy") == FALLBACK_TO_LOGS and exit_code != 0
    try:
        data = _tail(host_file, MAX_FILE_BYTES)
    except FileNotFoundError:
        data = b""
    except OSError as exc:
        return f"Error on reading termination log {host_file}: {exc}"
    if data or not fallback:
        return _decode(data)
    return log_tail(log_path)
