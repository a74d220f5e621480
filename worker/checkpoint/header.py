"""Parsing one safetensors file's header, checking every entry against the format and the file's size.

The format: 8 bytes little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets}}` (plus an
optional `__metadata__`), then the data. The header alone says every name, shape and dtype and where its bytes are,
so a checkpoint can be judged whole (a truncated file included) before one byte of it is copied anywhere.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch

from tidal.worker.checkpoint.errors import CheckpointError
from tidal.worker.checkpoint.json_doc import loads_object, short

# The safetensors dtype codes torch can hold; a file with any other code is refused (safetensors itself reads only
# the codes it knows, so such a file is not one it wrote).
DTYPES: dict[str, torch.dtype] = {
    code: dtype
    for code, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": getattr(torch, "uint64", None),
        "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dtype is not None
}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype without the module, e.g. "bfloat16" (the names the control API uses)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a file's header declares it."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def read_header(path: Path) -> list[StoredTensor]:
    """Every tensor of one file, or CheckpointError naming every entry that is malformed, lies past the end or
    shares bytes with another."""
    header, data_start, size = _header_json(path)
    tensors: list[StoredTensor] = []
    problems: list[str] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        parsed = _parse_entry(path, name, entry, data_start, size)
        if isinstance(parsed, str):
            problems.append(parsed)
        else:
            tensors.append(parsed)
    problems += _shared_bytes(path, tensors)
    if problems:
        raise CheckpointError(problems)
    return tensors


def _header_json(path: Path) -> tuple[dict[str, object], int, int]:
    """-> (the header object, where the data starts, the file's size)."""
    try:
        size = regular_file_size(path)
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError([f"{path.name}: not a safetensors file ({size} bytes)"])
            (length,) = struct.unpack("<Q", prefix)
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError([f"{path.name}: not a safetensors file (header length {length})"])
            header = loads_object(f.read(length))
    # ValueError covers bad JSON, bad UTF-8, and a document that is not an object or nests too deep.
    except (OSError, ValueError) as err:
        raise CheckpointError([f"{path.name}: cannot read the safetensors header: {err}"]) from err
    return header, 8 + length, size


def regular_file_size(path: Path) -> int:
    """The size of `path`, checked before it is opened to be a regular file: opening a FIFO blocks until a writer
    comes, and a device or socket has no size to check a header against. OSError otherwise."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} is not a regular file")
    return info.st_size


def _parse_entry(path: Path, name: str, entry: object, data_start: int, size: int) -> StoredTensor | str:
    """-> the tensor, or the problem with its entry."""
    where = f"{path.name}: {name}"
    if not isinstance(entry, dict):
        return f"{where}: its header entry is not an object"
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
        return f"{where}: unknown dtype {short(code)} (known: {', '.join(DTYPES)})"
    if not _is_list_of_naturals(shape):
        return f"{where}: malformed shape {short(shape)}"
    if not (_is_list_of_naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        return f"{where}: malformed data_offsets {short(offsets)}"
    begin, end = offsets
    dtype = DTYPES[code]
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        return f"{where} holds {end - begin} bytes, its shape and dtype need {needed}"
    if data_start + end > size:
        return f"{where} lies past the end of the file (truncated?)"
    return StoredTensor(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _shared_bytes(path: Path, tensors: list[StoredTensor]) -> list[str]:
    """A problem for each tensor whose bytes begin inside an earlier one's. The format gives every tensor bytes of its
    own (safetensors refuses a header that does not): two entries over the same bytes are a corrupt or forged header,
    and read, one tensor would be served another's values. Empty tensors own no bytes, and may share an offset."""
    problems = []
    furthest: StoredTensor | None = None  # of the tensors before, the one whose bytes reach furthest
    for tensor in sorted((t for t in tensors if t.nbytes), key=lambda t: (t.start, t.name)):
        if furthest is not None and tensor.start < furthest.start + furthest.nbytes:
            problems.append(f"{path.name}: {tensor.name} shares bytes with {furthest.name}")
        if furthest is None or tensor.start + tensor.nbytes > furthest.start + furthest.nbytes:
            furthest = tensor
    return problems


def _is_list_of_naturals(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
