"""Lifecycle refusals, each with the stable code the control API answers with.

The code says what went wrong; which HTTP status that is belongs to the control app (`control/app.py`), so the
lifecycle knows nothing about HTTP and another front end could report the same errors its own way.
"""

from __future__ import annotations

from typing import ClassVar

from tidal.contract.error_codes import ErrorCode
from tidal.worker.checkpoint.errors import summary


class LifecycleError(Exception):
    """Base of the refusals the control API reports; raise a subclass, each names its code."""

    code: ClassVar[ErrorCode]

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotLoadedError(LifecycleError):
    code = ErrorCode.NOT_LOADED


class BusyError(LifecycleError):
    code = ErrorCode.BUSY


class DrainTimeoutError(LifecycleError):
    code = ErrorCode.DRAIN_TIMEOUT


class WeightsUnavailableError(LifecycleError):
    code = ErrorCode.WEIGHTS_UNAVAILABLE


class HostMemoryError(LifecycleError):
    """A buffer an operation needs does not fit in host memory; nothing was changed."""

    code = ErrorCode.NO_HOST_MEMORY


class StaleEpochError(LifecycleError):
    """A group membership older than the one applied, or a different one under the same epoch."""

    code = ErrorCode.STALE_EPOCH


class GroupUnreachableError(LifecycleError):
    """An epoch could not be joined: its rendezvous or expert map did not complete in time (a member is missing);
    the previous state is kept."""

    code = ErrorCode.GROUP_UNREACHABLE


class ExpertsUnavailableError(LifecycleError):
    """An epoch's expert map cannot be installed on this rank (it does not fit, or the experts it must load are not
    readable); the previous state is kept."""

    code = ErrorCode.EXPERTS_UNAVAILABLE


class UploadNotFoundError(LifecycleError):
    code = ErrorCode.UNKNOWN_UPLOAD


class UploadOffsetError(LifecycleError):
    code = ErrorCode.BAD_OFFSET


class BadRequestError(LifecycleError):
    code = ErrorCode.INVALID_REQUEST


class CollectiveError(LifecycleError):
    code = ErrorCode.COLLECTIVE_FAILED


class CheckpointRejectedError(LifecycleError):
    """The new weights do not fit the model; nothing was changed."""

    code = ErrorCode.BAD_CHECKPOINT

    def __init__(self, problems: list[str]) -> None:
        super().__init__("checkpoint rejected, nothing changed: " + summary(problems))
        self.problems = problems
