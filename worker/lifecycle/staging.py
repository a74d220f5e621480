"""Putting a whole new checkpoint into host memory: from safetensors files (a local directory or a finished upload)
or from a trainer's broadcast. Every check happens before the first byte is written."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.worker.lifecycle.errors import CheckpointRejectedError, HostMemoryError
from tidal.worker.lifecycle.resident import TensorSlot, view_of
from tidal.worker.lifecycle.safetensors_reader import FileTensor, read_header, read_into
from tidal.worker.lifecycle.validation import Candidate, Expected, find_problems
from tidal.worker.loader.errors import ModelLoadError
from tidal.worker.loader.safetensors_files import checkpoint_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageReport:
    num_tensors: int
    num_bytes: int
    seconds: float


def checkpoint_tensors(source: Path) -> list[FileTensor]:
    """Every tensor of the checkpoint in `source` (one file, shards with an index, or all *.safetensors)."""
    if not source.is_dir():
        raise CheckpointRejectedError([f"{source} is not a directory"])
    try:
        files = checkpoint_files(source)
    except ModelLoadError as err:
        raise CheckpointRejectedError([str(err)]) from err
    found: dict[str, FileTensor] = {}
    for path in files:
        for tensor in read_header(path):
            if tensor.name in found:
                raise CheckpointRejectedError(
                    [f"{tensor.name} is in both {found[tensor.name].path.name} and {path.name}"]
                )
            found[tensor.name] = tensor
    return list(found.values())


def check_file_tensors(
    tensors: list[FileTensor], expected: dict[str, Expected], allow_extra: bool, is_ignored: Callable[[str], bool]
) -> list[FileTensor]:
    """-> the tensors to load (the model's), or CheckpointRejectedError with every problem found."""
    candidate = {t.name: Candidate(t.shape, t.dtype_name) for t in tensors}
    problems = find_problems(expected, candidate, allow_extra, is_ignored)
    if problems:
        raise CheckpointRejectedError(problems)
    return [t for t in tensors if t.name in expected]


def stage_file_tensors(tensors: list[FileTensor], host_views: dict[str, torch.Tensor]) -> StageReport:
    """Read each tensor into its host view: raw bytes when the dtypes match, else read then converted.
    A file that cannot be read to the end (an I/O error, shrunk since its header was checked) is a
    CheckpointRejectedError; the views may then hold part of the new checkpoint."""
    start = time.monotonic()
    try:
        num_bytes = _read_tensors(tensors, host_views)
    except OSError as err:
        raise CheckpointRejectedError([f"reading the checkpoint failed part way: {err}"]) from err
    seconds = time.monotonic() - start
    log.info("staged %d tensors (%.2f GiB) in %.2fs", len(tensors), num_bytes / 2**30, seconds)
    return StageReport(len(tensors), num_bytes, seconds)


def _read_tensors(tensors: list[FileTensor], host_views: dict[str, torch.Tensor]) -> int:
    direct = [(t, host_views[t.name]) for t in tensors if t.dtype == host_views[t.name].dtype]
    num_bytes = read_into(direct)
    for t in tensors:
        view = host_views[t.name]
        if t.dtype != view.dtype and t.dtype is not None:
            raw = torch.empty(t.shape, dtype=t.dtype)
            num_bytes += read_into([(t, raw)])
            view.copy_(raw)
    return num_bytes


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
