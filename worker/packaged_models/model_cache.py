"""A model directory built once per version under the cache, atomically: concurrent or interrupted builds never
leave a half-written directory where a reader would take it for a model."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_root() -> Path:
    """$TIDAL_CACHE/models, the cache `hack/env.sh` names (~/.cache/tidal unless set)."""
    return Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal")) / "models"


def cached_model_dir(final: Path, build: Callable[[Path], object]) -> Path:
    """`final` if it exists; else `build(tmp)` into a sibling temporary folder renamed to `final` when complete.

    The rename is atomic on one file system, so `final` existing means a finished build. Two processes may both
    build; the first rename wins and the other's copy is discarded (the same inputs give the same directory).
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not lost to a concurrent build: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
