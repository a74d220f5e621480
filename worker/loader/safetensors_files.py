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
        files = [model_path / name for name in sorted(set(weight_map.values()))]
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
