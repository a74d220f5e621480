"""Reading safetensors files straight into preallocated buffers, checking every header entry first.

The format: 8 bytes little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets}}`, then
the data. The header alone says every name, shape and dtype and where its bytes are, so a checkpoint can be judged
whole (including a truncated file) before one byte of it is copied anywhere.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.worker.lifecycle.errors import CheckpointRejectedError
from tidal.worker.lifecycle.host_bytes import byte_view

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20
_PIECE_BYTES = 64 * 2**20  # one read call; pieces of big tensors are read in parallel


@dataclass(frozen=True)
class FileTensor:
    name: str
    path: Path
    dtype_code: str  # as written in the file, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype_code)

    @property
    def dtype_name(self) -> str:
        dtype = self.dtype
        return str(dtype).removeprefix("torch.") if dtype is not None else self.dtype_code


def read_header(path: Path) -> list[FileTensor]:
    """Every tensor of one file, with offsets checked against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointRejectedError([f"{path.name}: not a safetensors file (header length {length})"])
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointRejectedError([f"{path.name}: cannot read the safetensors header: {err}"]) from err
    data_start = 8 + length
    tensors = []
    problems = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            code = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path.name}: malformed header entry for {name}")
            continue
        tensor = FileTensor(name, path, code, shape, data_start + begin, end - begin)
        dtype = tensor.dtype
        numel = 1
        for d in shape:
            numel *= d
        if dtype is not None and numel * dtype.itemsize != tensor.nbytes:
            problems.append(
                f"{path.name}: {name} holds {tensor.nbytes} bytes, its shape and dtype need {numel * dtype.itemsize}"
            )
        if begin < 0 or data_start + end > size:
            problems.append(f"{path.name}: {name} lies past the end of the file (truncated?)")
        tensors.append(tensor)
    if problems:
        raise CheckpointRejectedError(problems)
    return tensors


def read_into(jobs: list[tuple[FileTensor, torch.Tensor]], num_threads: int | None = None) -> int:
    """Copy each file tensor's bytes into its destination (a contiguous CPU tensor of the same byte size).
    -> bytes read. Files are read with positional reads from several threads (page cache or disk bound)."""
    fds: dict[Path, int] = {}
    pieces: list[tuple[int, int, memoryview]] = []  # (fd, file offset, destination bytes)
    try:
        for tensor, dest in jobs:
            if tensor.path not in fds:
                fds[tensor.path] = os.open(tensor.path, os.O_RDONLY)
            buf = byte_view(dest)
            if len(buf) != tensor.nbytes:
                raise ValueError(f"{tensor.name}: destination holds {len(buf)} bytes, the file {tensor.nbytes}")
            for start in range(0, tensor.nbytes, _PIECE_BYTES):
                pieces.append((fds[tensor.path], tensor.start + start, buf[start : start + _PIECE_BYTES]))
        workers = num_threads or min(16, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidal-read") as pool:
            return sum(pool.map(lambda p: _read_fully(*p), pieces))
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_fully(fd: int, offset: int, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
    return done
