"""Reading a model directory's config.json (through transformers) and the facts the engine derives from it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from tidal.worker.loader.errors import MissingModelFileError, ModelLoadError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model_path: Path) -> PretrainedConfig:
    if not model_path.is_dir():
        raise MissingModelFileError(f"model directory {model_path} does not exist")
    if not (model_path / "config.json").is_file():
        raise MissingModelFileError(f"{model_path / 'config.json'} is missing")
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(model_path, local_files_only=True)
        return config
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {model_path / 'config.json'}: {err}") from err


def resolve_dtype(requested: str, hf_config: PretrainedConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (config `dtype`, formerly `torch_dtype`); fp32 when it names none."""
    if requested != "auto":
        return _DTYPES[requested]
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared if declared in _DTYPES.values() else torch.float32
    return _DTYPES.get(str(declared), torch.float32)


def model_max_len(hf_config: PretrainedConfig) -> int:
    """The longest context the model supports with full attention. We don't implement sliding-window attention,
    so a model that uses one is limited to its window (within it, full attention computes the same thing)."""
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if limit <= 0:
        raise ModelLoadError("config.json sets no max_position_embeddings")
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and window < limit:
        log.warning("the model uses a sliding window of %d tokens: max_model_len is limited to it", window)
        limit = int(window)
    return limit


def eos_token_ids(model_path: Path, hf_config: PretrainedConfig) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (which may list several)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation_config = model_path / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
