"""Finding a checkpoint's files and reading their headers: every malformed header or index is a CheckpointError
listing its problems (never another exception), and a name held by two files is one of them."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.worker.checkpoint.directory import INDEX_FILE, checkpoint_files, stored_tensors
from tidal.worker.checkpoint.errors import CheckpointError, CheckpointFilesMissingError
from tidal.worker.checkpoint.header import read_header


def raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    """A file in the safetensors layout with any header (valid or not)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def entry(dtype: object = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}  # fmt: skip


def test_a_written_file_reads_back_with_names_shapes_dtypes_and_offsets(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, path, metadata={"format": "pt"})
    found = {t.name: t for t in read_header(path)}
    assert found["w"].shape == (3, 4) and found["w"].dtype == torch.float32 and found["w"].nbytes == 48
    assert found["b"].dtype_name == "bfloat16" and found["b"].nbytes == 10
    assert found["w"].start + 48 <= path.stat().st_size


@pytest.mark.parametrize(
    ("contents", "words"),
    [
        (b"", "not a safetensors file"),  # shorter than the length prefix
        (struct.pack("<Q", 10**12) + b"{}", "header length"),
        (struct.pack("<Q", 0), "header length"),
        (struct.pack("<Q", 5) + b"{nope", "cannot read the safetensors header"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "cannot read the safetensors header"),  # not UTF-8
        (struct.pack("<Q", 4) + b"null", "not a JSON object"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "cannot read the safetensors header"),
    ],
    ids=["empty", "huge-length", "zero-length", "not-json", "not-utf8", "null", "list", "deeply-nested"],
)
def test_a_malformed_header_is_a_clear_problem(tmp_path, contents, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(contents)
    with pytest.raises(CheckpointError, match=words) as err:
        read_header(path)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith("bad.safetensors: ")


def test_every_malformed_entry_is_named_at_once(tmp_path):
    header = {
        "__metadata__": {"format": "pt"},
        "ok": entry(),
        "not_object": [1, 2],
        "unknown_dtype": entry(dtype="F4_WHAT"),
        "unhashable_dtype": entry(dtype=["F32"]),
        "negative_dim": entry(shape=(-2,)),
        "bool_dim": entry(shape=[True, 2]),
        "float_offsets": entry(offsets=[0.0, 8.0]),
        "reversed_offsets": entry(offsets=(8, 0)),
        "three_offsets": entry(offsets=(0, 4, 8)),
        "size_mismatch": entry(shape=(3,)),
        "past_end": entry(offsets=(8, 16)),
    }
    path = raw_file(tmp_path / "m.safetensors", header, data=b"\0" * 8)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    problems = err.value.problems
    assert len(problems) == len(header) - 2, problems
    by_name = {p.split(": ")[1].split(" ")[0]: p for p in problems}
    assert "not an object" in by_name["not_object"]
    assert "unknown dtype 'F4_WHAT'" in by_name["unknown_dtype"] and "BF16" in by_name["unknown_dtype"]
    assert "malformed shape" in by_name["negative_dim"] and "malformed shape" in by_name["bool_dim"]
    assert all("malformed data_offsets" in by_name[n] for n in ("float_offsets", "reversed_offsets", "three_offsets"))
    assert "holds 8 bytes, its shape and dtype need 12" in by_name["size_mismatch"]
    assert "past the end of the file (truncated?)" in by_name["past_end"]


@pytest.mark.parametrize(
    ("offsets", "sharing"),
    [
        ({"a": (0, 8), "b": (4, 12)}, ["b shares bytes with a"]),
        ({"a": (0, 8), "b": (0, 8)}, ["b shares bytes with a"]),  # one tensor's bytes named twice
        ({"a": (0, 12), "b": (4, 8), "c": (8, 12)}, ["b shares bytes with a", "c shares bytes with a"]),
    ],
    ids=["overlapping", "same", "nested"],
)
def test_entries_that_share_bytes_are_refused(tmp_path, offsets, sharing):
    # Each tensor owns its bytes (safetensors refuses such a header too): read, one would serve another's values.
    header = {name: entry(shape=((end - begin) // 4,), offsets=(begin, end)) for name, (begin, end) in offsets.items()}
    with pytest.raises(CheckpointError) as err:
        read_header(raw_file(tmp_path / "m.safetensors", header, data=b"\0" * 12))
    assert err.value.problems == [f"m.safetensors: {problem}" for problem in sharing]


def test_empty_tensors_may_share_an_offset(tmp_path):
    header = {"a": entry(), "e": entry(shape=(0,), offsets=(8, 8)), "f": entry(shape=(0, 3), offsets=(8, 8))}
    path = raw_file(tmp_path / "m.safetensors", header, data=b"\0" * 8)
    assert {t.name for t in read_header(path)} == {"a", "e", "f"}


def test_a_truncated_file_is_refused_from_its_header(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(16)}, path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="past the end"):
        read_header(path)


def shards(directory: Path, tensors_of: dict[str, dict[str, torch.Tensor]], index: object | None = None) -> Path:
    directory.mkdir(exist_ok=True)
    weight_map = {}
    for file_name, tensors in tensors_of.items():
        save_file(tensors, directory / file_name)
        weight_map.update(dict.fromkeys(tensors, file_name))
    document = {"metadata": {}, "weight_map": weight_map} if index is None else index
    (directory / INDEX_FILE).write_text(document if isinstance(document, str) else json.dumps(document))
    return directory


def test_the_tensors_of_a_sharded_checkpoint_come_from_every_shard(tmp_path):
    directory = shards(tmp_path / "c", {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"y": torch.ones(3)}})
    (directory / "stray.safetensors").write_bytes(b"not listed, not read")
    assert checkpoint_files(directory) == [directory / "a.safetensors", directory / "b.safetensors"]
    found = stored_tensors(directory)
    assert {n: t.path.name for n, t in found.items()} == {"x": "a.safetensors", "y": "b.safetensors"}


def test_a_name_in_two_shards_is_a_problem_and_so_is_every_bad_shard(tmp_path):
    # The index says x is in a; b holds it too (an index names the files, the headers say what they hold).
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "c.safetensors"}}
    files = {"a.safetensors": {"x": torch.zeros(2)}, "b.safetensors": {"x": torch.ones(2), "y": torch.ones(1)},
             "c.safetensors": {"z": torch.ones(2)}}  # fmt: skip
    directory = shards(tmp_path / "c", files, index)
    (directory / "c.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError) as err:
        stored_tensors(directory)
    assert err.value.problems == [
        "x is in both a.safetensors and b.safetensors",
        "c.safetensors: not a safetensors file (6 bytes)",
    ]


def test_without_an_index_one_file_or_every_safetensors_file(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    save_file({"y": torch.zeros(1)}, tmp_path / "other.safetensors")
    assert checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    (tmp_path / "model.safetensors").unlink()
    save_file({"z": torch.zeros(1)}, tmp_path / "a.safetensors")
    assert set(stored_tensors(tmp_path)) == {"y", "z"}


def test_missing_directories_weights_and_shards_are_missing_files(tmp_path):
    with pytest.raises(CheckpointFilesMissingError, match="is not a directory"):
        checkpoint_files(tmp_path / "nope")
    with pytest.raises(CheckpointFilesMissingError, match="too long"):  # is_dir() raises ENAMETOOLONG
        checkpoint_files(tmp_path / ("a" * 300))
    with pytest.raises(CheckpointFilesMissingError, match=r"no \*\.safetensors"):
        checkpoint_files(tmp_path)
    directory = shards(tmp_path / "c", {"a.safetensors": {"x": torch.zeros(2)}})
    (directory / "a.safetensors").unlink()
    with pytest.raises(CheckpointFilesMissingError, match="lists shards that are missing"):
        checkpoint_files(directory)


@pytest.mark.parametrize(
    ("index", "words"),
    [
        ("{not json", "not a valid safetensors index"),
        ("null", "not a JSON object"),
        ('["w"]', "not a JSON object"),
        ({"metadata": {}}, "not a JSON object with a weight_map"),
        ({"weight_map": ["w"]}, "weight_map is not an object"),
        ("[" * 100_000 + "]" * 100_000, "not a valid safetensors index"),
        ({"weight_map": {}}, "lists no tensors"),
        ({"weight_map": {"w": "../outside.safetensors"}}, "not a plain file name: ../outside.safetensors"),
        ({"weight_map": {"w": "/abs/outside.safetensors"}}, "not a plain file name"),
        ({"weight_map": {"w": 5, "v": [1]}}, r"not a plain file name: 5, \[1\]"),
        # A plain name, but longer than a file system allows: looking it up raises ENAMETOOLONG, not "missing".
        ({"weight_map": {"w": "x" * 300 + ".safetensors"}}, "File name too long"),
    ],
)
def test_a_malformed_index_is_a_clear_problem(tmp_path, index, words):
    # A streamed index names files inside the upload only; a malformed one is a bad checkpoint, not a crash.
    directory = shards(tmp_path / "c", {"a.safetensors": {"x": torch.zeros(2)}}, index=index)
    with pytest.raises(CheckpointError, match=words) as err:
        checkpoint_files(directory)
    assert not isinstance(err.value, CheckpointFilesMissingError)


def test_a_directory_too_deep_to_look_up_its_files_is_a_clear_problem(tmp_path):
    # The directory itself can be looked up, but not a file in it: the path would pass PATH_MAX (ENAMETOOLONG).
    length = os.pathconf(tmp_path, "PC_PATH_MAX") - 20  # the directory's, in components of at most 200 bytes
    directory = tmp_path
    while len(str(directory)) < length:
        directory /= "d" * min(200, length - len(str(directory)))
    directory.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="File name too long"):
        checkpoint_files(directory)


def nested(value: object, depth: int) -> object:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"dtype": "F32", "shape": nested([2], 20), "data_offsets": [0, 8]}},
        {"__metadata__": {"a": nested([], 20)}},
    ],
    ids=["deep-shape", "deep-metadata"],
)
def test_a_header_nested_deeper_than_any_real_one_is_refused(tmp_path, header):
    # Deep enough to parse, but its repr in a message (or any walk of it) could exhaust the stack.
    with pytest.raises(CheckpointError, match="nested deeper than"):
        read_header(raw_file(tmp_path / "deep.safetensors", header, b"\0" * 8))


def test_a_long_malformed_value_is_shortened_in_the_message(tmp_path):
    path = raw_file(tmp_path / "long.safetensors", {"w": {"dtype": "F32", "shape": [-1] * 100_000}})
    with pytest.raises(CheckpointError, match="malformed shape") as err:
        read_header(path)
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("which", ["single", "index", "shard", "glob"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path, which):
    directory = tmp_path / "c"
    directory.mkdir()
    if which == "single":
        os.mkfifo(directory / "model.safetensors")
    elif which == "index":
        os.mkfifo(directory / INDEX_FILE)
    elif which == "shard":
        (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
        os.mkfifo(directory / "a.safetensors")
    else:
        os.mkfifo(directory / "a.safetensors")
    # Opening a FIFO for reading blocks until a writer comes: a refusal here means it was never opened.
    with pytest.raises(CheckpointError, match="not a regular file"):
        stored_tensors(directory)
