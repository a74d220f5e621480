"""The lifecycle's side of staging a checkpoint from disk (a local directory or a finished upload) in host memory: every
check of names, shapes and dtypes happens before the first byte is written, of values (NaN, Inf) as they are staged,
and any checkpoint problem is a CheckpointRejectedError (code bad_checkpoint; nothing served changed). Also the spare
buffer an update is staged in when the host buffer is the served copy."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from tidal.worker.checkpoint.directory import stored_tensors
from tidal.worker.checkpoint.errors import CheckpointError
from tidal.worker.checkpoint.fp8_targets import plan_destinations, plan_expected, stored_dtypes
from tidal.worker.checkpoint.header import StoredTensor
from tidal.worker.checkpoint.judge import Expected, tensors_to_read
from tidal.worker.checkpoint.reader import LoadReport, read_tensors
from tidal.worker.lifecycle.errors import CheckpointRejectedError, HostMemoryError
from tidal.worker.lifecycle.resident import TensorSlot, view_of

log = logging.getLogger(__name__)

# How an update request skips tensors the model does not have (the field of the control API's requests).
EXTRAS_HINT = "allow_extra_tensors skips them"


def check_directory(
    source: Path,
    expected: Mapping[str, Expected],
    allow_extra: bool,
    is_ignored: Callable[[str], bool],
    fp8_scales: Mapping[str, str] | None = None,
) -> list[StoredTensor]:
    """-> the tensors of the checkpoint in `source` to stage, or CheckpointRejectedError with every problem.
    `fp8_scales`: the served FP8 weights' scale names (fp8_targets.fp8_weight_scales), which a checkpoint may give in
    a float dtype (quantized on staging) or in e4m3 with their scales."""
    with _rejected_on_problems():
        stored = stored_tensors(source)
        expected = plan_expected(expected, fp8_scales or {}, stored_dtypes(stored))
        return tensors_to_read(
            stored, expected, allow_extra=allow_extra, is_ignored=is_ignored, extras_hint=EXTRAS_HINT
        )


def stage_tensors(
    tensors: list[StoredTensor],
    host_views: dict[str, torch.Tensor],
    deadline: float | None = None,
    fp8_scales: Mapping[str, str] | None = None,
) -> LoadReport:
    """Read each tensor into its host view (an FP8 weight stored in a float dtype: quantized into its view and its
    scale's). A file that cannot be read to the end, or by `deadline`, or a tensor holding NaN or Inf (checked as it
    is read, before any quantization), is a CheckpointRejectedError (caused by the CheckpointError); the views may
    then hold part of the new checkpoint."""
    destinations = plan_destinations(host_views, fp8_scales or {}, {t.name: t.dtype_name for t in tensors})
    with _rejected_on_problems():
        report = read_tensors(tensors, destinations, deadline=deadline)
    log.info("staged %d tensors (%.2f GiB) in %.2fs", report.num_tensors, report.num_bytes / 2**30, report.seconds)
    return report


@contextlib.contextmanager
def _rejected_on_problems() -> Iterator[None]:
    try:
        yield
    except CheckpointError as err:
        raise CheckpointRejectedError(err.problems) from err


def spare_host_buffer(slots: dict[str, TensorSlot], nbytes: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A second host buffer laid out like the host buffer, and its named views; HostMemoryError if the host
    cannot hold it. Not pinned: pinning costs seconds per GiB, and it only receives bytes from files or a group."""
    try:
        spare = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]; bytes between slots are never read
    except RuntimeError as err:  # torch's CPU allocator reports "not enough memory" as a RuntimeError
        raise HostMemoryError(
            f"asleep at level 1, the host buffer holds the only copy of the served weights, and a second buffer of "
            f"{nbytes / 2**30:.2f} GiB to stage the update beside it could not be allocated ({err}); nothing "
            "changed: wake the model first (the update is then staged while the device copy serves)"
        ) from err
    return spare, {name: view_of(spare, slot) for name, slot in slots.items()}
