"""Reading stored tensors into buffers the caller gives: positional reads of 64 MiB pieces on several threads.

A destination that is a contiguous CPU tensor of the stored dtype (a pinned host buffer's view, a CPU model's
weight) receives the file's bytes directly. Any other (another dtype, a device tensor, a strided view) goes through
two staging buffers in turn (pinned when a destination is on a GPU): while `copy_` converts and moves what one holds
(asynchronously to a GPU), the next part of the checkpoint is read into the other. A `QuantizeInto` destination (an
FP8 weight, tidal.worker.checkpoint.fp8_targets) is staged too, in whole rows, and quantized on its device.
Every float tensor's values are checked as they arrive (`values.FiniteCheck`): one holding NaN or Inf fails the
read once all is read, naming each such tensor (a quantized weight's values are checked before quantization).
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.worker.checkpoint.errors import CheckpointError, ReadTimeoutError
from tidal.worker.checkpoint.fp8_targets import Destination, QuantizeInto
from tidal.worker.checkpoint.header import StoredTensor
from tidal.worker.checkpoint.host_bytes import byte_view
from tidal.worker.checkpoint.values import FiniteCheck

PIECE_BYTES = 64 * 2**20  # one read call; pieces of big tensors are read in parallel
# Each of the two staging buffers: pinning costs ~0.5 s per GiB, so they are small and read in small pieces.
STAGING_BYTES = 256 * 2**20
STAGING_PIECE_BYTES = 16 * 2**20
STAGING_ALIGNMENT = 256  # where each staged part starts in a staging buffer (a multiple of every element size)
# The stored dtypes a read converts into the destination's own: the float formats a plain copy can convert (fp8
# weights would need their scales).
CONVERTIBLE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


@dataclass(frozen=True)
class LoadReport:
    num_tensors: int
    num_bytes: int
    seconds: float


def read_tensors(
    tensors: Sequence[StoredTensor],
    destinations: Mapping[str, Destination],
    num_threads: int | None = None,
    deadline: float | None = None,
) -> LoadReport:
    """Copy each tensor into `destinations[name]` (same shape; the dtype is converted). A file that cannot be read
    to the end (an I/O error, shrunk since its header was read) is a CheckpointError, and a tensor holding NaN or
    Inf a NonFiniteValuesError naming every such tensor; the destinations may then hold part or all of the
    checkpoint. `deadline` (time.monotonic()): past it, ReadTimeoutError."""
    start = time.monotonic()
    jobs = [(t, destinations[t.name]) for t in tensors]
    for tensor, dest in jobs:
        if tuple(dest.shape) != tensor.shape:
            raise ValueError(f"{tensor.name}: destination shape {list(dest.shape)}, stored {list(tensor.shape)}")
    direct = [(t, dest) for t, dest in jobs if isinstance(dest, torch.Tensor) and _takes_bytes(t, dest)]
    staged = [(t, dest) for t, dest in jobs if not (isinstance(dest, torch.Tensor) and _takes_bytes(t, dest))]
    finite = FiniteCheck()
    try:
        num_bytes = read_into(direct, num_threads, deadline)
        for tensor, dest in direct:
            finite.add(tensor.name, dest)  # the file's bytes as they are
        num_bytes += _read_staged(staged, num_threads, deadline, finite)
    except OSError as err:
        raise CheckpointError([f"reading the checkpoint failed part way: {err}"]) from err
    finite.raise_if_any()
    return LoadReport(len(jobs), num_bytes, time.monotonic() - start)


def read_into(
    jobs: Sequence[tuple[StoredTensor, torch.Tensor]], num_threads: int | None = None, deadline: float | None = None
) -> int:
    """Copy each tensor's bytes into its destination (a contiguous CPU tensor of the same byte size). -> bytes read."""
    pieces: list[tuple[Path, int, memoryview]] = []  # (file, offset, destination bytes)
    for tensor, dest in jobs:
        buf = byte_view(dest)
        if len(buf) != tensor.nbytes:
            raise ValueError(f"{tensor.name}: destination holds {len(buf)} bytes, the file {tensor.nbytes}")
        pieces += _pieces(tensor.path, tensor.start, buf, PIECE_BYTES)
    return _read_pieces(pieces, [dest for _, dest in jobs], num_threads, deadline)


@dataclass(frozen=True)
class _Part:
    """Elements [begin, end) of a tensor, read through a staging buffer."""

    tensor: StoredTensor
    dest: Destination
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return (self.end - self.begin) * self.tensor.dtype.itemsize


def _read_staged(
    jobs: list[tuple[StoredTensor, Destination]], num_threads: int | None, deadline: float | None, finite: FiniteCheck
) -> int:
    if not jobs:
        return 0
    on_gpu = any(dest.device.type == "cuda" for _, dest in jobs)
    parts = _parts(jobs)
    size = max([STAGING_BYTES, *(p.nbytes for p in parts)])
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(2)]  # [size] each
    copied: list[list[torch.cuda.Event]] = [[], []]  # when each buffer's last copies are done
    num_bytes = 0
    for i, fill in enumerate(_fills(parts, size)):
        buffer = buffers[i % 2]
        for done in copied[i % 2]:
            done.synchronize()
        offsets = list(itertools.accumulate((_staged_bytes(p) for p in fill), initial=0))
        view = byte_view(buffer)
        pieces = [
            piece
            for part, offset in zip(fill, offsets, strict=False)
            for piece in _pieces(
                part.tensor.path,
                part.tensor.start + part.begin * part.tensor.dtype.itemsize,
                view[offset : offset + part.nbytes],
                STAGING_PIECE_BYTES,
            )
        ]
        num_bytes += _read_pieces(pieces, [buffer], num_threads, deadline)
        for part, offset in zip(fill, offsets, strict=False):
            staged = buffer[offset : offset + part.nbytes].view(part.tensor.dtype)  # [end - begin]
            if isinstance(part.dest, QuantizeInto):  # whole rows (see _parts)
                finite.add(part.tensor.name, staged)  # before quantizing: a scale would hide what was wrong
                row_length = part.dest.row_length()
                part.dest.write_rows(part.begin // row_length, staged.view(-1, row_length))
            else:
                dest = _destination(part.dest, part)
                dest.copy_(staged.view(_shape(part)), non_blocking=True)
                # As converted: a value past the destination dtype's range became Inf too.
                converted = part.tensor.dtype if dest.dtype != part.tensor.dtype else None
                finite.add(part.tensor.name, dest, converted)
        # Each device's copies run on its current stream; an event there says when the buffer may be refilled.
        devices = {part.dest.device for part in fill if part.dest.device.type == "cuda"}
        copied[i % 2] = [torch.cuda.current_stream(device).record_event() for device in devices]
    for done in itertools.chain(*copied):
        done.synchronize()
    return num_bytes


def _parts(jobs: list[tuple[StoredTensor, Destination]]) -> list[_Part]:
    """Each tensor whole, or, when it is bigger than a staging buffer and its destination is contiguous, in slices
    of whole elements that fit one; a quantizing destination's slices are whole rows."""
    parts = []
    for tensor, dest in jobs:
        numel = math.prod(tensor.shape)
        if isinstance(dest, QuantizeInto):
            row_length = max(dest.row_length(), 1)
            step = max(1, STAGING_BYTES // (row_length * tensor.dtype.itemsize)) * row_length
        else:
            step = max(1, STAGING_BYTES // tensor.dtype.itemsize) if dest.is_contiguous() else max(numel, 1)
        parts += [_Part(tensor, dest, begin, min(begin + step, numel)) for begin in range(0, numel, step)]
    return parts


def _staged_bytes(part: _Part) -> int:
    """The room a part takes in a staging buffer: its bytes rounded up, so that the next part starts where a view of
    any dtype may begin (torch views a byte buffer as another dtype only at offsets its element size divides)."""
    return -(-part.nbytes // STAGING_ALIGNMENT) * STAGING_ALIGNMENT


def _fills(parts: list[_Part], size: int) -> Iterator[list[_Part]]:
    """Consecutive parts, as many as fit one staging buffer at a time."""
    fill: list[_Part] = []
    used = 0
    for part in parts:
        if fill and used + _staged_bytes(part) > size:
            yield fill
            fill, used = [], 0
        fill.append(part)
        used += _staged_bytes(part)
    if fill:
        yield fill


def _destination(dest: torch.Tensor, part: _Part) -> torch.Tensor:
    if part.begin == 0 and part.end == dest.numel():
        return dest
    return dest.view(-1)[part.begin : part.end]


def _shape(part: _Part) -> tuple[int, ...]:
    numel = math.prod(part.tensor.shape)
    return part.tensor.shape if part.begin == 0 and part.end == numel else (part.end - part.begin,)


def _pieces(path: Path, start: int, buf: memoryview, piece_bytes: int) -> list[tuple[Path, int, memoryview]]:
    return [(path, start + at, buf[at : at + piece_bytes]) for at in range(0, len(buf), piece_bytes)]


def _read_pieces(
    pieces: list[tuple[Path, int, memoryview]],
    owners: list[torch.Tensor],
    num_threads: int | None,
    deadline: float | None,
) -> int:
    """Positional reads from several threads: page-cache or disk bound, not bound by one core's memcpy. `owners`:
    the tensors whose memory the pieces' views are (the views do not keep them alive)."""
    if not pieces:
        return 0
    return _PieceReads(pieces, owners, min(num_threads or min(16, os.cpu_count() or 1), len(pieces))).run(deadline)


class _PieceReads:
    """One batch of pieces read by daemon threads, waited for until a deadline.

    A read blocked in the kernel (a stalled network file system) cannot be interrupted: past the deadline the
    caller gets ReadTimeoutError while such a thread stays blocked; it reads no further piece once it returns, and
    the files are closed only then. Daemon threads: a stuck one does not hold up the process's exit."""

    def __init__(
        self, pieces: list[tuple[Path, int, memoryview]], owners: list[torch.Tensor], num_threads: int
    ) -> None:
        self._pending = list(reversed(pieces))
        # Held while a thread runs (it holds this object): a read that returns after the deadline still writes into
        # memory that exists. (Memory released by other means, a region's, is the caller's to keep: `settled`.)
        self._owners = owners
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._running = num_threads
        self._stopped = False
        self._error: OSError | None = None
        self._num_bytes = 0
        self._fds: dict[Path, int] = {}
        self.settled = threading.Event()  # every thread returned and the files are closed

    def run(self, deadline: float | None) -> int:
        try:
            for path, _, _ in self._pending:
                if path not in self._fds:
                    self._fds[path] = _open_regular(path)
        except OSError:
            self._close()
            raise
        for i in range(self._num_threads):
            threading.Thread(target=self._work, name=f"tidal-read-{i}", daemon=True).start()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.settled.wait(timeout):
            with self._lock:
                self._stopped = True
            raise ReadTimeoutError(self.settled)
        if self._error is not None:
            raise self._error
        return self._num_bytes

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped or not self._pending:
                        return
                    path, offset, buf = self._pending.pop()
                try:
                    n = _read_fully(self._fds[path], offset, buf)
                except OSError as err:
                    with self._lock:
                        self._error, self._stopped = self._error or err, True
                    return
                with self._lock:
                    self._num_bytes += n
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._close()

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._owners = []
        self.settled.set()


def _open_regular(path: Path) -> int:
    """O_NONBLOCK: a file replaced by a FIFO since its header was read must not block the open; it is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def _takes_bytes(tensor: StoredTensor, dest: torch.Tensor) -> bool:
    return dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == tensor.dtype


def _read_fully(fd: int, offset: int, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
    return done
