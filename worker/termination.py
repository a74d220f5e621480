"""The worker's last words: why the process ends, written where Kubernetes reads a container's termination message.

The kubelet puts that file's text into the container's `lastState.terminated.message`, so `kubectl describe pod` and
the operator's Degraded condition show the worker's own error instead of a log someone has to fetch. The path comes
from `TIDAL_TERMINATION_MESSAGE_PATH`, which the operator's pod builder sets to the container's
terminationMessagePath (`/dev/termination-log`). It is read from the environment, not from `WorkerConfig`: an invalid
configuration is one of the things to report. Without it nothing is written (a worker started by hand has no such
file, and `/dev` is no place to create one).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TERMINATION_MESSAGE_ENV = "TIDAL_TERMINATION_MESSAGE_PATH"
# The kubelet reads at most the last 4 KiB of the file: a longer message would lose its beginning, which says most.
MAX_MESSAGE_BYTES = 4096
_CUT = "…"


def fit(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` in at most `limit` bytes of UTF-8, cut at a character boundary and marked when cut."""
    data = message.encode()
    if len(data) <= limit:
        return message
    room = limit - len(_CUT.encode())
    return data[:room].decode(errors="ignore") + _CUT


def describe(exc: BaseException) -> str:
    """`ValueError: bad value`: the exception's type and message, the way a person reads a fatal error."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class TerminationLog:
    """Where this process writes its termination message (None: nowhere)."""

    path: Path | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TerminationLog:
        value = environ.get(TERMINATION_MESSAGE_ENV, "").strip()
        return cls(Path(value) if value else None)

    def write(self, message: str) -> None:
        """Best effort: a file that cannot be written is reported on stderr, and the process ends as it would have
        (the container's log, with FallbackToLogsOnError, still says why)."""
        if self.path is None:
            return
        try:
            self.path.write_text(fit(message), encoding="utf-8")
        except OSError as exc:
            print(f"cannot write the termination message to {self.path}: {exc}", file=sys.stderr)
