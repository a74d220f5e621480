"""A model of a preset's shape with seeded random weights made where they live (no checkpoint on disk).

Writing and reading 16 GB of random bf16 through a disk would cost the GPU run minutes; drawing them on the
device takes well under a second. transformers then loads the very same tensors (transformers_side.py), so both
implementations run identical weights. The scales follow tidal.worker.testing.tiny_models: unit-variance
activations through every matrix, norms near 1, so logits are spread and greedy choices are rarely near-ties.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.loader.hf_config import load_hf_config
from tidal.worker.loader.model_loader import LoadedModel, build_model
from tidal.worker.memory.provider import TorchMemory


@torch.no_grad()
def fill_random_(weights: dict[str, torch.Tensor], seed: int) -> None:
    """Draw every checkpoint tensor in place, in name order, from one generator on the tensors' device."""
    device = next(iter(weights.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(weights):
        t = weights[name]
        if name.endswith("norm.weight"):
            t.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            t.normal_(0.0, 0.1, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0, generator=gen)
        else:  # [out, in]
            t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)


@torch.no_grad()
def build_random_model(model_dir: Path, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    """Our implementation of the architecture in `model_dir`/config.json, weights drawn on `device` (plain torch
    memory, as `LLMEngine.from_config` uses by default)."""
    start = time.monotonic()
    hf_config = load_hf_config(model_dir)
    memory = TorchMemory()
    model, region = build_model(hf_config, dtype, device, memory)
    weights = model.checkpoint_weights()
    fill_random_(weights, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = LoadReport(len(weights), weight_bytes(model), time.monotonic() - start)
    return LoadedModel(model, hf_config, dtype, report, region, memory)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (embedding and LM head both counted, as the issue's 16.06 GB for Llama-3-8B does)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
