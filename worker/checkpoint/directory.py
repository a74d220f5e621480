"""A checkpoint directory: its safetensors files (one file, the shards an index lists, or all *.safetensors) and
the tensors their headers declare."""

from __future__ import annotations

from pathlib import Path

from tidal.worker.checkpoint.errors import CheckpointError, CheckpointFilesMissingError, some_of
from tidal.worker.checkpoint.header import StoredTensor, read_header, regular_file_size
from tidal.worker.checkpoint.json_doc import loads_object

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_INDEX_BYTES = 100 * 2**20  # a name -> file map; far above what the largest models list


def checkpoint_files(directory: Path) -> list[Path]:
    try:
        is_dir = directory.is_dir()
    except OSError as exc:  # is_dir() swallows only "not there": a name too long (ENAMETOOLONG) raises
        raise CheckpointFilesMissingError([f"{str(directory)[:200]}: {exc.strerror}"]) from exc
    if not is_dir:
        raise CheckpointFilesMissingError([f"{directory} is not a directory"])
    # exists(), not is_file(): an index or file that is there but not a regular file (a FIFO) is refused when it
    # is read (see header.regular_file_size), rather than silently passed over for other files.
    index = directory / INDEX_FILE
    if _exists(index):
        return _shards(index)
    single = directory / SINGLE_FILE
    if _exists(single):
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointFilesMissingError([f"no *.safetensors weights in {directory}"])
    return files


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Name -> tensor over every file of the checkpoint; CheckpointError lists every malformed header and every
    name that more than one file holds."""
    found: dict[str, StoredTensor] = {}
    problems: list[str] = []
    for path in checkpoint_files(directory):
        try:
            tensors = read_header(path)
        except CheckpointError as err:
            problems += err.problems
            continue
        for tensor in tensors:
            if tensor.name in found:
                problems.append(f"{tensor.name} is in both {found[tensor.name].path.name} and {path.name}")
            else:
                found[tensor.name] = tensor
    if problems:
        raise CheckpointError(problems)
    return found


def _shards(index: Path) -> list[Path]:
    """The files `index` lists, each a plain name beside it: an index that came with a streamed upload must not
    point the reader at other files."""
    weight_map = _weight_map(index)
    names = {n for n in weight_map.values() if isinstance(n, str) and Path(n).name == n and n not in ("", ".", "..")}
    bad = sorted({str(n) for n in weight_map.values() if not (isinstance(n, str) and n in names)})
    if bad:
        raise CheckpointError([f"{index} names shards that are not a plain file name: {some_of(bad)}"])
    files = [index.parent / name for name in sorted(names)]
    if not files:
        raise CheckpointError([f"{index} lists no tensors"])
    missing = [str(f) for f in files if not _exists(f)]
    if missing:
        raise CheckpointFilesMissingError([f"{index} lists shards that are missing: {some_of(missing)}"])
    return files


def _exists(path: Path) -> bool:
    """Path.exists(), with CheckpointError where the file system cannot look the name up: exists() answers False
    only for "not there", and raises OSError for a name it cannot even search for (a shard name an index gives
    longer than NAME_MAX, a directory deep enough that a file in it passes PATH_MAX: ENAMETOOLONG)."""
    try:
        return path.exists()
    except OSError as exc:
        raise CheckpointError([f"{str(path)[:200]}: {exc.strerror}"]) from exc


def _weight_map(index: Path) -> dict[str, object]:
    invalid = f"{index} is not a valid safetensors index"
    try:
        size = regular_file_size(index)
        if size > MAX_INDEX_BYTES:
            raise ValueError(f"{size} bytes, more than {MAX_INDEX_BYTES}")
        document = loads_object(index.read_bytes())
    # ValueError covers bad JSON, bad UTF-8, and a document that is not an object or nests too deep.
    except (OSError, ValueError) as err:
        raise CheckpointError([f"{invalid}: {err}"]) from err
    if "weight_map" not in document:
        raise CheckpointError([f"{invalid}: it is not a JSON object with a weight_map"])
    weight_map = document["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError([f"{invalid}: weight_map is not an object"])
    return weight_map
