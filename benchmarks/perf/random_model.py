"""A model of a preset's shape with seeded random weights made where they live (no checkpoint on disk), or, for
benchmarks whose workers are processes that read a checkpoint, the same weights written as one.

Writing and reading 16 GB of random bf16 through a disk would cost the GPU run minutes; drawing them on the
device takes well under a second. transformers then loads the very same tensors (transformers_side.py), so both
implementations run identical weights. The scales follow tidal.worker.testing.tiny_models: unit-variance
activations through every matrix, norms near 1, so logits are spread and greedy choices are rarely near-ties.
`write_random_checkpoint` draws the same values in the same order, so a worker reading its files serves the model
`build_random_model` builds with the same seed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tidal.kernels.fp8_linear import quantize_rows_into_
from tidal.worker.checkpoint.fp8_targets import fp8_weight_scales
from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.engine.config import WeightDType
from tidal.worker.loader.hf_config import load_hf_config
from tidal.worker.loader.model_loader import LoadedModel, build_model
from tidal.worker.memory.provider import TorchMemory
from tidal.worker.models.registry import resolve_model_class

SHARD_BYTES = 4 * 2**30


def _draw_(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    if name.endswith("norm.weight"):
        t.normal_(1.0, 0.1, generator=gen)
    elif name.endswith(".bias"):
        t.normal_(0.0, 0.1, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        t.normal_(0.0, 1.0, generator=gen)
    else:  # [out, in]
        t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)


@torch.no_grad()
def fill_random_(weights: dict[str, torch.Tensor], seed: int, dtype: torch.dtype | None = None) -> None:
    """Draw every checkpoint tensor in place, in name order, from one generator on the tensors' device. An FP8
    weight (and its scale) gets the values a `dtype` weight would, quantized as loading a checkpoint would."""
    device = next(iter(weights.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    scales = fp8_weight_scales(weights)
    for name in sorted(set(weights) - set(scales.values())):
        if name in scales:
            drawn = torch.empty(weights[name].shape, dtype=dtype or torch.bfloat16, device=device)
            _draw_(name, drawn, gen)
            quantize_rows_into_(drawn, weights[name], weights[scales[name]])
        else:
            _draw_(name, weights[name], gen)


@torch.no_grad()
def write_random_checkpoint(model_dir: Path, dtype: torch.dtype, device: torch.device, seed: int) -> int:
    """The weights `build_random_model(model_dir, dtype, device, seed)` draws, written into `model_dir` (which has
    the config) as safetensors shards and their index, one tensor at a time -> bytes written. The config's dtype is
    set to `dtype`, so a worker started with dtype "auto" serves them as drawn. Drawing on a GPU is fast; the disk
    sets the pace (a 61 GB model takes about a minute on the H200 machines)."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    hf_config = load_hf_config(model_dir)
    meta = torch.device("meta")
    shapes = resolve_model_class(hf_config.architectures).from_hf_config(hf_config, dtype, meta).checkpoint_weights()
    gen = torch.Generator(device=device).manual_seed(seed)

    def drawn() -> Iterable[tuple[str, torch.Tensor]]:
        for name in sorted(shapes):
            t = torch.empty(shapes[name].shape, dtype=dtype, device=device)
            _draw_(name, t, gen)
            yield name, t.cpu()

    return save_shards(drawn(), model_dir)


def save_shards(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int = SHARD_BYTES) -> int:
    """(name, CPU tensor) pairs -> `model-NNNNN.safetensors` files of about `shard_bytes` each and
    `model.safetensors.index.json`, as a sharded Hugging Face checkpoint has them -> bytes written."""
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    shard_size = total = num_shards = 0

    def flush() -> None:
        nonlocal shard, shard_size, num_shards
        if shard:
            name = f"model-{num_shards:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard, shard_size, num_shards = {}, 0, num_shards + 1

    for name, tensor in tensors:
        shard[name] = tensor
        shard_size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if shard_size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return total


@torch.no_grad()
def build_random_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, seed: int, weight_dtype: WeightDType = "auto"
) -> LoadedModel:
    """Our implementation of the architecture in `model_dir`/config.json, weights drawn on `device` (plain torch
    memory, as `LLMEngine.from_config` uses by default). `weight_dtype` "fp8": the same draws, the projections' and
    the experts' quantized (tidal.worker.layers.fp8_weights)."""
    start = time.monotonic()
    hf_config = load_hf_config(model_dir)
    memory = TorchMemory()
    model, region = build_model(hf_config, dtype, device, memory, weight_dtype=weight_dtype)
    weights = model.checkpoint_weights()
    fill_random_(weights, seed, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = LoadReport(len(weights), weight_bytes(model), time.monotonic() - start)
    return LoadedModel(model, hf_config, dtype, report, region, memory)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (embedding and LM head both counted, as the issue's 16.06 GB for Llama-3-8B does)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
