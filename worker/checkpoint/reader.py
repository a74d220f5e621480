"""Reading stored tensors into buffers the caller gives: positional reads of 64 MiB pieces on several threads.

A destination that is a contiguous CPU tensor of the stored dtype (a pinned host buffer's view, a CPU model's
weight) receives the file's bytes directly. Any other (another dtype, a device tensor, a strided view) is read into
host memory first, a batch at a time, and then `copy_` converts and moves it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.worker.checkpoint.errors import CheckpointError
from tidal.worker.checkpoint.header import StoredTensor
from tidal.worker.checkpoint.host_bytes import byte_view

PIECE_BYTES = 64 * 2**20  # one read call; pieces of big tensors are read in parallel
STAGING_BYTES = 2**30  # host memory that tensors read before a copy_ take at a time (at least one tensor)


@dataclass(frozen=True)
class LoadReport:
    num_tensors: int
    num_bytes: int
    seconds: float


def read_tensors(
    tensors: Sequence[StoredTensor], destinations: Mapping[str, torch.Tensor], num_threads: int | None = None
) -> LoadReport:
    """Copy each tensor into `destinations[name]` (same shape; the dtype is converted). A file that cannot be read
    to the end (an I/O error, shrunk since its header was read) is a CheckpointError; the destinations may then
    hold part of the checkpoint."""
    start = time.monotonic()
    jobs = [(t, destinations[t.name]) for t in tensors]
    for tensor, dest in jobs:
        if tuple(dest.shape) != tensor.shape:
            raise ValueError(f"{tensor.name}: destination shape {list(dest.shape)}, stored {list(tensor.shape)}")
    direct = [(t, dest) for t, dest in jobs if _takes_bytes(t, dest)]
    through_host = [(t, dest) for t, dest in jobs if not _takes_bytes(t, dest)]
    try:
        num_bytes = read_into(direct, num_threads)
        for batch in _batches(through_host):
            staged = [torch.empty(t.shape, dtype=t.dtype) for t, _ in batch]  # [*shape], the stored dtype
            num_bytes += read_into([(t, raw) for (t, _), raw in zip(batch, staged, strict=True)], num_threads)
            for (_, dest), raw in zip(batch, staged, strict=True):
                dest.copy_(raw)
    except OSError as err:
        raise CheckpointError([f"reading the checkpoint failed part way: {err}"]) from err
    return LoadReport(len(jobs), num_bytes, time.monotonic() - start)


def read_into(jobs: Sequence[tuple[StoredTensor, torch.Tensor]], num_threads: int | None = None) -> int:
    """Copy each tensor's bytes into its destination (a contiguous CPU tensor of the same byte size). -> bytes read.
    Positional reads from several threads: page-cache or disk bound, not bound by one core's memcpy."""
    fds: dict[Path, int] = {}
    pieces: list[tuple[int, int, memoryview]] = []  # (fd, file offset, destination bytes)
    try:
        for tensor, dest in jobs:
            if tensor.path not in fds:
                fds[tensor.path] = os.open(tensor.path, os.O_RDONLY)
            buf = byte_view(dest)
            if len(buf) != tensor.nbytes:
                raise ValueError(f"{tensor.name}: destination holds {len(buf)} bytes, the file {tensor.nbytes}")
            for offset in range(0, tensor.nbytes, PIECE_BYTES):
                pieces.append((fds[tensor.path], tensor.start + offset, buf[offset : offset + PIECE_BYTES]))
        if not pieces:
            return 0
        workers = min(num_threads or min(16, os.cpu_count() or 1), len(pieces))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidal-read") as pool:
            return sum(pool.map(lambda piece: _read_fully(*piece), pieces))
    finally:
        for fd in fds.values():
            os.close(fd)


def _takes_bytes(tensor: StoredTensor, dest: torch.Tensor) -> bool:
    return dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == tensor.dtype


def _batches(
    jobs: list[tuple[StoredTensor, torch.Tensor]],
) -> Iterator[list[tuple[StoredTensor, torch.Tensor]]]:
    batch: list[tuple[StoredTensor, torch.Tensor]] = []
    size = 0
    for job in jobs:
        if batch and size + job[0].nbytes > STAGING_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(job)
        size += job[0].nbytes
    if batch:
        yield batch


def _read_fully(fd: int, offset: int, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
    return done
