"""Loading a local Hugging Face model directory: config, our model implementation, weights and tokenizer.

The model is built on the meta device, its parameters are bound to their one place in a region from the engine's
memory provider, its derived buffers are computed on the device, and only then is the checkpoint read into the
parameters: the weights are allocated once, where they stay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tidal.kernels.fp8_linear import check_fp8_weights_fit
from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.layers.expert_parallel import ExpertParallelSettings
from tidal.worker.layers.fp8_weights import WEIGHT_DTYPES, hold_fp8_weights
from tidal.worker.loader.errors import MissingModelFileError, ModelLoadError
from tidal.worker.loader.hf_config import load_hf_config, resolve_dtype
from tidal.worker.loader.model_weights import find_checkpoint, load_weights
from tidal.worker.memory.parameters import place_parameters
from tidal.worker.memory.provider import MemoryProvider, TorchMemory
from tidal.worker.memory.regions import DeviceRegion
from tidal.worker.models.base import CausalLM
from tidal.worker.models.registry import resolve_model_class

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: PretrainedConfig
    dtype: torch.dtype
    report: LoadReport
    weights: DeviceRegion  # where every parameter lives (views into it)
    memory_provider: MemoryProvider  # made `weights`; the engine takes its KV cache from it too


def build_model(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    memory: MemoryProvider,
    expert_parallel: ExpertParallelSettings | None = None,
    weight_dtype: str = "auto",
) -> tuple[CausalLM, DeviceRegion]:
    """Our implementation of `hf_config`'s architecture, its parameters placed (uninitialised) in one region from
    `memory`, its buffers computed on `device`. -> the model (in eval mode) and the weights' region.
    `expert_parallel`: this process's place in its expert-parallel group (a model with experts then holds only its
    rank's). `weight_dtype` "fp8": its projections hold FP8 weights (tidal.worker.layers.fp8_weights)."""
    model_cls = resolve_model_class(getattr(hf_config, "architectures", None))
    log.info("building %s (%s, weights %s) on %s", model_cls.__name__, dtype, weight_dtype, device)
    with torch.no_grad():
        model = model_cls.from_hf_config(hf_config, dtype, torch.device("meta"), expert_parallel)
        if weight_dtype == "fp8":
            check_fp8_weights_fit(device)
            log.info("%d projections hold FP8 weights", hold_fp8_weights(model))
        elif weight_dtype != "auto":
            raise ValueError(f"unknown weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
        weights = place_parameters(model, memory, device)
        model.materialize_buffers(device)
    return model.eval(), weights


def load_model(
    model_path: Path,
    dtype: str,
    device: torch.device,
    memory: MemoryProvider | None = None,
    expert_parallel: ExpertParallelSettings | None = None,
    weight_dtype: str = "auto",
) -> LoadedModel:
    """`memory`: where the weights go (default: plain torch storage). `expert_parallel`: see `build_model`; only the
    experts this rank holds are read. `weight_dtype`: see `build_model`."""
    memory = memory or TorchMemory()
    hf_config = load_hf_config(model_path)
    stored = find_checkpoint(model_path)
    torch_dtype = resolve_dtype(dtype, hf_config)
    model, weights = build_model(hf_config, torch_dtype, device, memory, expert_parallel, weight_dtype)
    log.info("loading %s into %.2f GiB (%s)", model_path, weights.nbytes / 2**30, type(weights).__name__)
    report = load_weights(model_path, stored, model)
    log.info(
        "loaded %d tensors (%.1f MiB) from %d file(s) in %.2fs",
        report.num_tensors,
        report.num_bytes / 2**20,
        len({t.path for t in stored.values()}),
        report.seconds,
    )
    return LoadedModel(model, hf_config, torch_dtype, report, weights, memory)


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    if not (model_path / "tokenizer.json").is_file() and not (model_path / "tokenizer_config.json").is_file():
        raise MissingModelFileError(f"no tokenizer in {model_path} (tokenizer.json / tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (ValueError, OSError) as err:
        raise ModelLoadError(f"cannot load the tokenizer from {model_path}: {err}") from err
