"""What can be wrong with a checkpoint, as a list of problems that each caller turns into its own error."""

from __future__ import annotations

import threading


class CheckpointError(Exception):
    """The checkpoint cannot be read as it is: a malformed index or header, a truncated or unreadable file."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class CheckpointFilesMissingError(CheckpointError):
    """The directory, its weights, or a shard its index names do not exist."""


class CheckpointUnfitError(CheckpointError):
    """The checkpoint is readable, but its tensors do not fit what the caller expects (names, shapes, dtypes)."""


class ReadTimeoutError(CheckpointError):
    """Reading the checkpoint passed its deadline. `settled` is set once every read thread has returned: until
    then a read blocked in the kernel may still write into the destinations."""

    def __init__(self, settled: threading.Event) -> None:
        super().__init__(["reading the checkpoint did not finish in time (a stalled file system?)"])
        self.settled = settled


# How much of a problem list a message shows: a header may declare a million malformed entries, or names megabytes
# long, and the message goes into an HTTP answer, the logs and the operator's status.
MAX_PROBLEMS_SHOWN = 8
MAX_PROBLEM_CHARS = 1000


def summary(problems: list[str]) -> str:
    """The first problems, each shortened, joined for a message, and how many more there are."""
    shown = [p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS] + "..." for p in problems[:MAX_PROBLEMS_SHOWN]]
    more = len(problems) - len(shown)
    return "; ".join(shown) + (f" (and {more} more problems)" if more > 0 else "")


def some_of(items: list[str], limit: int = 8) -> str:
    """The first `limit` items for an error message, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")
