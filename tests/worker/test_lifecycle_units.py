"""Pure parts of the lifecycle: uploads, checksums, collective errors."""

from __future__ import annotations

import resource
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

from tidal.worker.lifecycle.checksum import overall_digest, tensor_digest, weights_digests
from tidal.worker.lifecycle.errors import (
    BadRequestError,
    BusyError,
    CollectiveError,
    UploadNotFoundError,
    UploadOffsetError,
)
from tidal.worker.lifecycle.uploads import Uploads
from tidal.worker.testing.silent_port import SilentPort


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


def test_a_chunk_whose_write_failed_part_way_is_written_whole_by_its_retry(tmp_path):
    uploads = Uploads(tmp_path)
    upload = uploads.start(False)
    data = bytes(range(256)) * 320
    uploads.write_chunk(upload.upload_id, "model.safetensors", 0, data[:40_000])
    # A file size limit stands for a disk that fills: the write stops part way, with some of its bytes written.
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65_536, limit[1]))
    try:
        with pytest.raises(OSError):
            uploads.write_chunk(upload.upload_id, "model.safetensors", 40_000, data[40_000:])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert upload.received["model.safetensors"] == 40_000  # the offset the retry is sent at
    uploads.write_chunk(upload.upload_id, "model.safetensors", 40_000, data[40_000:])
    assert (upload.directory / "model.safetensors").read_bytes() == data


def test_a_chunk_is_checked_and_its_file_held_before_its_body_arrives(tmp_path):
    uploads = Uploads(tmp_path)
    upload = uploads.start(False)
    # The refusals of write_chunk, before any byte: a bad name, no such upload, not the offset expected.
    with pytest.raises(BadRequestError):
        uploads.begin_chunk(upload.upload_id, "../escape.safetensors", 0)
    with pytest.raises(UploadNotFoundError):
        uploads.begin_chunk("caf\u00e9", "model.safetensors", 0)
    with pytest.raises(UploadOffsetError, match="offset 3, but 0 bytes"):
        uploads.begin_chunk(upload.upload_id, "model.safetensors", 3)
    claim = uploads.begin_chunk(upload.upload_id, "model.safetensors", 0)
    # While its body arrives, the file takes no other chunk, written or announced; other files do; and the upload
    # cannot be finished (that chunk would be lost).
    with pytest.raises(BusyError, match="still arriving"):
        uploads.begin_chunk(upload.upload_id, "model.safetensors", 0)
    with pytest.raises(BusyError, match=r"model\.safetensors at offset 0 is still arriving; finish once"):
        uploads.finish(upload.upload_id)
    with pytest.raises(BusyError, match="still arriving"):
        uploads.write_chunk(upload.upload_id, "model.safetensors", 0, b"abc")
    uploads.end_chunk(uploads.begin_chunk(upload.upload_id, "config.json", 0))
    assert upload.received == {}
    # Its write ends the claim, and the offset is checked again there (the claim's check was an early answer).
    uploads.write_chunk(upload.upload_id, "model.safetensors", 0, b"abc", claim)
    assert upload.received == {"model.safetensors": 3}
    uploads.end_chunk(claim)  # again: no effect
    given_up = uploads.begin_chunk(upload.upload_id, "model.safetensors", 3)
    uploads.end_chunk(given_up)  # a body that never arrived whole: nothing written, the offset free again
    uploads.write_chunk(upload.upload_id, "model.safetensors", 3, b"def")
    # The write checks the offset again: a claim given up, whose offset another chunk took meanwhile, writes nothing.
    late = uploads.begin_chunk(upload.upload_id, "model.safetensors", 6)
    uploads.end_chunk(late)
    uploads.write_chunk(upload.upload_id, "model.safetensors", 6, b"g")
    with pytest.raises(UploadOffsetError, match="offset 6, but 7 bytes"):
        uploads.write_chunk(upload.upload_id, "model.safetensors", 6, b"x", late)
    # A chunk refused at its write ends its claim too: here its upload was replaced while its body arrived.
    claim = uploads.begin_chunk(upload.upload_id, "model.safetensors", 7)
    uploads.start(False)
    with pytest.raises(UploadNotFoundError):
        uploads.write_chunk(upload.upload_id, "model.safetensors", 7, b"h", claim)
    assert upload.arriving == {} and not upload.directory.exists()


def test_checksums_depend_on_bytes_dtype_and_shape_only():
    t = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone()) == tensor_digest(torch.arange(8.0)[:6])
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))
    digests = weights_digests({"x": t, "y": t.reshape(2, 3)})
    assert overall_digest(digests) == overall_digest(dict(reversed(list(digests.items()))))


def test_a_trainer_that_cannot_be_reached_is_a_collective_failure():
    from tidal.worker.lifecycle.collective import join_group

    # 502 collective_failed, as the contract says, rather than torch's own error as a 500.
    with pytest.raises(CollectiveError, match="cannot join the trainer's group at 127\\.0\\.0\\.1:1"):
        join_group("127.0.0.1", 1, 1, 2, "gloo", 0.5)


def test_a_rendezvous_that_accepts_and_never_answers_fails_in_time():
    from tidal.worker.lifecycle.collective import join_group

    # torch's store client bounds its connect by the timeout, not the ping that follows: a frozen trainer held the
    # join (and the update) forever.
    with SilentPort() as silent:
        start = time.monotonic()
        with pytest.raises(
            CollectiveError, match=f"127\\.0\\.0\\.1:{silent.port}: its rendezvous did not answer within 1s"
        ):
            _returns_within(10.0, lambda: join_group("127.0.0.1", silent.port, 1, 2, "gloo", 1.0))
        assert time.monotonic() - start < 3.0
        # Nothing of the attempt stays connected: no store left that a trainer waking up could still talk to.
        assert silent.accepted and silent.hung_up_by_clients(timeout_s=2.0)


def _returns_within(seconds: float, call: Callable[[], object]) -> object:
    """call(), failing the test instead of hanging it when it has not returned after `seconds`."""
    outcome: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds:g}s")
    if errors:
        raise errors[0]
    return outcome[0]


def test_announced_tensor_shapes_are_not_negative():
    from pydantic import ValidationError

    from tidal.contract.control_api import TensorSpec

    assert TensorSpec(name="w", shape=[0, 3], dtype="float32").shape == [0, 3]
    with pytest.raises(ValidationError, match="greater than or equal to 0"):  # else torch.empty fails mid-transfer
        TensorSpec(name="extra", shape=[-1, 4], dtype="float32")
