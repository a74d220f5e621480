"""A `.gguf` file given as the worker's model: dequantized once into a cache entry named by its contents.

The key is the file's SHA-256 (not its path or mtime), so a copy of the same file anywhere reuses the entry and a
changed file never serves stale weights; hashing a few hundred MB costs a second or two against the minutes of a
conversion.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tidal.worker.packaged_models.gguf_to_hf import convert_gguf
from tidal.worker.packaged_models.model_cache import cached_model_dir, default_cache_root

GGUF_SUFFIX = ".gguf"
# Bump when convert_gguf writes a different directory from the same file, so earlier entries are not reused.
FORMAT_VERSION = 1
_CHUNK = 16 << 20


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def gguf_entry_name(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"gguf-{path.stem.lower()}-{digest.hexdigest()[:16]}-f{FORMAT_VERSION}"


def gguf_model_dir(path: Path, cache_root: Path | None = None) -> Path:
    """The converted directory of `path`, built on first use under `cache_root` ($TIDAL_CACHE/models)."""
    final = (cache_root or default_cache_root()) / gguf_entry_name(path)
    return cached_model_dir(final, lambda tmp: convert_gguf(path, tmp))
