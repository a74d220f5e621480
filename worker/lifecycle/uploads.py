"""Streamed weight uploads: a trainer sends safetensors files in chunks; they are spooled to a private directory
and, at `finish`, go through exactly the checks and the copy of an update from disk.

One upload at a time: a new `start` discards an unfinished one (a trainer that restarts starts over). Chunks of a
file are appended in order; each names its byte offset, so a chunk sent twice or out of order is refused with the
offset expected instead of corrupting the file.

A chunk is checked before its body is read (`begin_chunk`: the upload, the file name, the offset), so a chunk that
cannot be taken costs no memory; the check also claims the file for it until it is written or given up, and a second
chunk of the same file meanwhile is refused as busy rather than read in full only to lose at the write. The write
checks everything again (`write_chunk`): the claim's check is an early answer, not the guard.
"""

from __future__ import annotations

import logging
import re
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tidal.worker.lifecycle.errors import BadRequestError, BusyError, UploadNotFoundError, UploadOffsetError

log = logging.getLogger(__name__)

# A plain file name: no directory part, so that a chunk can only land in its upload's directory. The control API
# documents it as the `file` parameter's pattern.
FILE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.(safetensors|json)$"
_FILE_NAME = re.compile(FILE_NAME_PATTERN)


@dataclass
class Upload:
    upload_id: str
    allow_extra_tensors: bool
    directory: Path
    received: dict[str, int] = field(default_factory=dict)  # file name -> bytes so far
    arriving: dict[str, ChunkClaim] = field(default_factory=dict)  # file name -> the chunk whose body is arriving

    @property
    def num_bytes(self) -> int:
        return sum(self.received.values())


@dataclass(eq=False)
class ChunkClaim:
    """A chunk that passed its checks and whose body is arriving: its file takes no other chunk until it is written
    (`Uploads.write_chunk`) or given up (`Uploads.end_chunk`)."""

    upload: Upload
    file_name: str
    offset: int


class Uploads:
    def __init__(self, spool_dir: Path | None = None) -> None:
        self._spool_dir = spool_dir
        self._current: Upload | None = None
        # Chunks arrive on worker threads; the offset check and the append must not interleave, nor a file's claim
        # with another chunk's check of that file.
        self._lock = threading.Lock()

    def start(self, allow_extra_tensors: bool) -> Upload:
        with self._lock:
            self.discard_current()
            directory = Path(tempfile.mkdtemp(prefix="tidal-upload-", dir=self._spool_dir))
            self._current = Upload(secrets.token_hex(8), allow_extra_tensors, directory)
            return self._current

    def get(self, upload_id: str) -> Upload:
        # Bytes: compare_digest refuses non-ASCII str, and the id comes from a URL path that may hold anything.
        current = self._current
        if current is None or not secrets.compare_digest(current.upload_id.encode(), upload_id.encode()):
            raise UploadNotFoundError(f"no upload {upload_id!r} in progress (a newer start replaces an older upload)")
        return current

    def begin_chunk(self, upload_id: str, file_name: str, offset: int) -> ChunkClaim:
        """Check a chunk before its body is read, with the refusals its write would answer (a bad file name, no such
        upload, not the offset the file expects), and busy while another chunk of the same file is arriving; then
        claim the file for it. End the claim by writing the chunk with it, or with `end_chunk` when its body does not
        arrive whole. Waits for a write in progress (call it off the event loop)."""
        _check_file_name(file_name)
        with self._lock:
            upload = self.get(upload_id)
            _check_offset(upload, file_name, offset)
            held = upload.arriving.get(file_name)
            if held is not None:
                raise _busy(file_name, held)
            claim = upload.arriving[file_name] = ChunkClaim(upload, file_name, offset)
            return claim

    def end_chunk(self, claim: ChunkClaim) -> None:
        """Give up a claim whose chunk was not written (its body did not arrive whole); no effect once it ended.
        Waits for a write in progress (call it off the event loop)."""
        with self._lock:
            _release(claim)

    def write_chunk(
        self, upload_id: str, file_name: str, offset: int, data: bytes | bytearray, claim: ChunkClaim | None = None
    ) -> Upload:
        """Append `data` to `file_name` of the upload; blocking file I/O (call it off the event loop). `claim`: the
        chunk's from `begin_chunk`, ended here whatever the outcome; without one, the write is refused as busy while
        another chunk of the file is arriving."""
        _check_file_name(file_name)
        with self._lock:
            try:
                upload = self.get(upload_id)
                held = upload.arriving.get(file_name)
                if held is not None and held is not claim:
                    raise _busy(file_name, held)
                have = _check_offset(upload, file_name, offset)
                with (upload.directory / file_name).open("ab") as f:
                    # Past `have`: what a write that failed part way (a full disk) left; kept, it would shift every
                    # byte after it, and the file could still pass its header's checks.
                    f.truncate(have)
                    f.write(data)
                upload.received[file_name] = have + len(data)
                return upload
            finally:
                if claim is not None:
                    _release(claim)

    def finish(self, upload_id: str) -> Upload:
        """Detach the upload for applying; the caller removes its directory with `remove()`. Busy while a chunk's
        body is still arriving: finished now, the upload would lose that chunk (and the file the rest of its
        bytes), and the checkpoint be refused for a truncated file. Busy too while another call holds the uploads
        (a chunk being written), at once: the caller is the event loop, which must not wait out a write that takes
        as long as the spool volume does (for good, if it stalls)."""
        if not self._lock.acquire(blocking=False):
            raise BusyError("a chunk is being written (or an upload started); finish once every chunk sent is answered")
        try:
            upload = self.get(upload_id)
            if upload.arriving:
                held = next(iter(upload.arriving.values()))
                raise BusyError(
                    f"upload {upload_id}: a chunk of {held.file_name} at offset {held.offset} is still arriving; "
                    "finish once every chunk sent is answered"
                )
            if not upload.received:
                raise BadRequestError(f"upload {upload_id} received no files")
            self._current = None
            return upload
        finally:
            self._lock.release()

    def reattach(self, upload: Upload) -> bool:
        """Make a finished upload current again, so that a failed finish the caller may retry (a drain timeout)
        can be. -> False, with nothing changed, when a newer upload has started meanwhile."""
        with self._lock:
            if self._current is not None:
                return False
            self._current = upload
            return True

    def discard(self, upload_id: str) -> None:
        with self._lock:
            self.get(upload_id)
            self.discard_current()

    def discard_current(self) -> None:
        if self._current is not None:
            log.info("discarding unfinished upload %s", self._current.upload_id)
            self.remove(self._current)
            self._current = None

    @staticmethod
    def remove(upload: Upload) -> None:
        shutil.rmtree(upload.directory, ignore_errors=True)


def _check_file_name(file_name: str) -> None:
    if not _FILE_NAME.match(file_name):
        raise BadRequestError(f"file name {file_name!r} must be a plain *.safetensors or *.json name")


def _check_offset(upload: Upload, file_name: str, offset: int) -> int:
    """-> the bytes of the file received so far, which `offset` must be (under the lock)."""
    have = upload.received.get(file_name, 0)
    if offset != have:
        raise UploadOffsetError(f"{file_name}: chunk at offset {offset}, but {have} bytes were received so far")
    return have


def _busy(file_name: str, held: ChunkClaim) -> BusyError:
    return BusyError(
        f"{file_name}: a chunk at offset {held.offset} is still arriving; send this one again once that one is answered"
    )


def _release(claim: ChunkClaim) -> None:
    """End `claim` if it still holds its file (under the lock)."""
    arriving = claim.upload.arriving
    if arriving.get(claim.file_name) is claim:
        del arriving[claim.file_name]
