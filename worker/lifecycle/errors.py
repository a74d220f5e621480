"""Lifecycle failures, each with the HTTP status and the stable code the control API answers with."""

from __future__ import annotations


class LifecycleError(Exception):
    status = 409
    code = "conflict"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotLoadedError(LifecycleError):
    status = 503
    code = "not_loaded"


class BusyError(LifecycleError):
    code = "busy"


class DrainTimeoutError(LifecycleError):
    code = "drain_timeout"


class WeightsUnavailableError(LifecycleError):
    code = "weights_unavailable"


class HostMemoryError(LifecycleError):
    """A buffer an operation needs does not fit in host memory; nothing was changed."""

    code = "no_host_memory"


class StaleEpochError(LifecycleError):
    """A group membership older than the one applied, or a different one under the same epoch."""

    code = "stale_epoch"


class UploadNotFoundError(LifecycleError):
    status = 404
    code = "unknown_upload"


class UploadOffsetError(LifecycleError):
    code = "bad_offset"


class BadRequestError(LifecycleError):
    status = 400
    code = "invalid_request"


class CollectiveError(LifecycleError):
    status = 502
    code = "collective_failed"


class CheckpointRejectedError(LifecycleError):
    """The new weights do not fit the model; nothing was changed."""

    status = 422
    code = "bad_checkpoint"

    def __init__(self, problems: list[str]) -> None:
        super().__init__("checkpoint rejected, nothing changed: " + "; ".join(problems))
        self.problems = problems
