"""Streamed weight uploads: a trainer sends safetensors files in chunks; they are spooled to a private directory
and, at `finish`, go through exactly the checks and the copy of an update from disk.

One upload at a time: a new `start` discards an unfinished one (a trainer that restarts starts over). Chunks of a
file are appended in order; each names its byte offset, so a chunk sent twice or out of order is refused with the
offset expected instead of corrupting the file.
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

from tidal.worker.lifecycle.errors import BadRequestError, UploadNotFoundError, UploadOffsetError

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

    @property
    def num_bytes(self) -> int:
        return sum(self.received.values())


class Uploads:
    def __init__(self, spool_dir: Path | None = None) -> None:
        self._spool_dir = spool_dir
        self._current: Upload | None = None
        # Chunks arrive on worker threads; the offset check and the append must not interleave.
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

    def write_chunk(self, upload_id: str, file_name: str, offset: int, data: bytes | bytearray) -> Upload:
        """Append `data` to `file_name` of the upload; blocking file I/O (call it off the event loop)."""
        if not _FILE_NAME.match(file_name):
            raise BadRequestError(f"file name {file_name!r} must be a plain *.safetensors or *.json name")
        with self._lock:
            upload = self.get(upload_id)
            have = upload.received.get(file_name, 0)
            if offset != have:
                raise UploadOffsetError(f"{file_name}: chunk at offset {offset}, but {have} bytes were received so far")
            with (upload.directory / file_name).open("ab") as f:
                # Past `have`: what a write that failed part way (a full disk) left; kept, it would shift every byte
                # after it, and the file could still pass its header's checks.
                f.truncate(have)
                f.write(data)
            upload.received[file_name] = have + len(data)
            return upload

    def finish(self, upload_id: str) -> Upload:
        """Detach the upload for applying; the caller removes its directory with `remove()`."""
        with self._lock:
            upload = self.get(upload_id)
            if not upload.received:
                raise BadRequestError(f"upload {upload_id} received no files")
            self._current = None
            return upload

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
