"""Pure parts of the lifecycle: candidate checks, safetensors headers, uploads, checksums."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tidal.worker.lifecycle.checksum import overall_digest, tensor_digest, weights_digests
from tidal.worker.lifecycle.errors import (
    BadRequestError,
    CheckpointRejectedError,
    CollectiveError,
    UploadNotFoundError,
    UploadOffsetError,
)
from tidal.worker.lifecycle.safetensors_reader import read_header, read_into
from tidal.worker.lifecycle.uploads import Uploads
from tidal.worker.lifecycle.validation import Candidate, Expected, find_problems

EXPECTED = {"a": Expected((2, 3), frozenset({"bfloat16"})), "b": Expected((4,), frozenset({"bfloat16", "float32"}))}


def test_find_problems_names_every_kind_of_mismatch():
    ok = {"a": Candidate((2, 3), "bfloat16"), "b": Candidate((4,), "float32")}
    assert find_problems(EXPECTED, ok, allow_extra=False) == []
    bad = {"a": Candidate((3, 2), "float16"), "c": Candidate((1,), "bfloat16"), "inv_freq": Candidate((1,), "x")}
    problems = find_problems(EXPECTED, bad, allow_extra=False, is_ignored=lambda n: n == "inv_freq")
    assert problems == [
        "missing tensors: b",
        "wrong shapes: a [3, 2] (model [2, 3])",
        "wrong dtypes: a float16 (model accepts bfloat16)",
        "tensors the model does not have (allow_extra_tensors to skip them): c",
    ]
    assert find_problems(EXPECTED, {**ok, "c": Candidate((1,), "bfloat16")}, allow_extra=True) == []
    many = {f"x{i:02d}": Candidate((1,), "bfloat16") for i in range(10)}
    assert find_problems(EXPECTED, {**ok, **many}, allow_extra=False)[-1].endswith("x06, x07 (and 2 more)")


def test_safetensors_header_checks_and_direct_reads(tmp_path):
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    found = {t.name: t for t in read_header(path)}
    assert found["w"].shape == (3, 4) and found["w"].dtype_name == "float32" and found["b"].dtype_name == "bfloat16"
    dest = {n: torch.empty_like(t) for n, t in tensors.items()}
    assert read_into([(found[n], dest[n]) for n in dest]) == 48 + 10
    assert all(torch.equal(dest[n], tensors[n]) for n in tensors)
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointRejectedError, match="past the end"):
        read_header(truncated)
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointRejectedError, match="not a safetensors file"):
        read_header(garbage)


def test_uploads_append_in_order_and_one_at_a_time(tmp_path):
    uploads = Uploads(tmp_path)
    first = uploads.start(False)
    uploads.write_chunk(first.upload_id, "model.safetensors", 0, b"abc")
    with pytest.raises(UploadOffsetError, match="3 bytes"):
        uploads.write_chunk(first.upload_id, "model.safetensors", 0, b"abc")
    with pytest.raises(BadRequestError):
        uploads.write_chunk(first.upload_id, "../escape.safetensors", 0, b"x")
    second = uploads.start(False)  # replaces the first, whose files are removed
    assert not first.directory.exists()
    with pytest.raises(UploadNotFoundError):
        uploads.get(first.upload_id)
    with pytest.raises(UploadNotFoundError):  # an id from the URL path may be any text: a 404, not a 500
        uploads.write_chunk("caf\u00e9", "model.safetensors", 0, b"x")
    with pytest.raises(BadRequestError, match="no files"):
        uploads.finish(second.upload_id)


def test_checksums_depend_on_bytes_dtype_and_shape_only():
    t = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone()) == tensor_digest(torch.arange(8.0)[:6])
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))
    digests = weights_digests({"x": t, "y": t.reshape(2, 3)})
    assert overall_digest(digests) == overall_digest(dict(reversed(list(digests.items()))))


def test_a_shard_index_must_name_plain_files_beside_it(tmp_path):
    from tidal.worker.lifecycle.staging import checkpoint_tensors

    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"")
    upload = tmp_path / "upload"
    upload.mkdir()
    index = upload / "model.safetensors.index.json"
    # A streamed index names files inside the upload only; a malformed one is a bad checkpoint (422), not a 500.
    for weight_map, words in (({"w": "../outside.safetensors"}, "plain file name"),
                              ({"w": str(outside)}, "plain file name"),
                              ({"w": 5, "v": [1]}, "plain file name"),
                              (["w"], "weight_map")):  # fmt: skip
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointRejectedError, match=words):
            checkpoint_tensors(upload)


def test_a_trainer_that_cannot_be_reached_is_a_collective_failure():
    from tidal.worker.lifecycle.collective import join_group

    # 502 collective_failed, as the contract says, rather than torch's own error as a 500.
    with pytest.raises(CollectiveError, match="cannot join the trainer's group at 127\\.0\\.0\\.1:1"):
        join_group("127.0.0.1", 1, 1, 2, "gloo", 0.5)


def test_announced_tensor_shapes_are_not_negative():
    from pydantic import ValidationError

    from tidal.contract.control_api import TensorSpec

    assert TensorSpec(name="w", shape=[0, 3], dtype="float32").shape == [0, 3]
    with pytest.raises(ValidationError, match="greater than or equal to 0"):  # else torch.empty fails mid-transfer
        TensorSpec(name="extra", shape=[-1, 4], dtype="float32")
