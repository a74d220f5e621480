"""The control API's error codes: the `code` of every `ControlError` a worker answers with, and only those.

One source for both halves: the worker's lifecycle errors carry these members, its control app gives each one HTTP
status (`tidal.worker.control.app.HTTP_STATUS`, checked complete by a test), and the operator decides with them which
refusals mean "not now". A value is part of the wire contract: add members, never rename one. Codes the operator's
client makes up for calls that got no readable answer are not here (see `tidal.operator.workerclient.CallErrorCode`):
a worker never sends them.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"  # a body or parameter is malformed, or does not fit this worker (its rank)
    UNAUTHORIZED = "unauthorized"  # missing or wrong bearer token; the call was not even routed
    NOT_FOUND = "not_found"  # no such route (a typo, or a worker older than the caller)
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the route exists, the method does not
    UNKNOWN_UPLOAD = "unknown_upload"  # no streamed upload with this id (a newer start replaced it, or it ended)
    BAD_OFFSET = "bad_offset"  # a streamed chunk that does not start where the file's received bytes end
    BUSY = "busy"  # another operation (sleep, wake, update), or another chunk of the same file, is in progress; retry
    DRAIN_TIMEOUT = "drain_timeout"  # running requests did not finish within drain_timeout_s; nothing changed
    WEIGHTS_UNAVAILABLE = "weights_unavailable"  # dropped by a level-2 sleep and not re-readable, or nothing to hash
    NO_HOST_MEMORY = "no_host_memory"  # a host buffer the operation needs does not fit; nothing changed
    STALE_EPOCH = "stale_epoch"  # a group membership older than the applied one, or another under the same epoch
    BAD_CHECKPOINT = "bad_checkpoint"  # the new weights do not fit the model; nothing changed
    COLLECTIVE_FAILED = "collective_failed"  # joining the trainer's group or receiving its broadcast failed
    GROUP_UNREACHABLE = "group_unreachable"  # an epoch's rendezvous or map did not complete: a member is missing
    EXPERTS_UNAVAILABLE = "experts_unavailable"  # the epoch's experts cannot be held (no room, no checkpoint to read)
    NOT_LOADED = "not_loaded"  # the model is not loaded yet (the worker is starting)
    INTERNAL = "internal"  # an unexpected failure inside the worker; the message names the exception
