"""Loading a local Hugging Face model directory: config, our model implementation, weights and tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.loader.errors import MissingModelFileError, ModelLoadError
from tidal.worker.loader.hf_config import load_hf_config, resolve_dtype
from tidal.worker.loader.model_weights import find_checkpoint, load_weights
from tidal.worker.models.base import CausalLM
from tidal.worker.models.registry import resolve_model_class

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: PretrainedConfig
    dtype: torch.dtype
    report: LoadReport


def load_model(model_path: Path, dtype: str, device: torch.device) -> LoadedModel:
    hf_config = load_hf_config(model_path)
    model_cls = resolve_model_class(getattr(hf_config, "architectures", None))
    stored = find_checkpoint(model_path)
    torch_dtype = resolve_dtype(dtype, hf_config)
    log.info("building %s (%s) on %s from %s", model_cls.__name__, torch_dtype, device, model_path)
    with torch.no_grad():
        model = model_cls.from_hf_config(hf_config, torch_dtype, device)
    report = load_weights(model_path, stored, model)
    log.info(
        "loaded %d tensors (%.1f MiB) from %d file(s) in %.2fs",
        report.num_tensors,
        report.num_bytes / 2**20,
        len({t.path for t in stored.values()}),
        report.seconds,
    )
    return LoadedModel(model.eval(), hf_config, torch_dtype, report)


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    if not (model_path / "tokenizer.json").is_file() and not (model_path / "tokenizer_config.json").is_file():
        raise MissingModelFileError(f"no tokenizer in {model_path} (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (ValueError, OSError) as err:
        raise ModelLoadError(f"cannot load the tokenizer from {model_path}: {err}") from err
