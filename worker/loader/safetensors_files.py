"""Finding a checkpoint's safetensors files (one file, or shards listed in model.safetensors.index.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.worker.loader.errors import MissingModelFileError, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {err}") from err
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} is not a valid safetensors index: weight_map is not an object")
        names = list(weight_map.values())
        # Shards sit beside the index: a streamed upload's index must not point the loader at other files.
        bad = sorted({str(n) for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")})
        if bad:
            raise ModelLoadError(f"{index} names shards that are not a plain file name: {', '.join(bad)}")
        files = [model_path / name for name in sorted(set(names))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise MissingModelFileError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise MissingModelFileError(f"no *.safetensors weights in {model_path}")
    return files
