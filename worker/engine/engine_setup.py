"""Deciding the engine's device, context length and KV cache size from its config and the loaded model."""

from __future__ import annotations

import logging
import time

import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES, gpu_kv_cache_bytes, num_blocks_for_bytes
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.loader.errors import ModelLoadError

log = logging.getLogger(__name__)


class EngineConfigError(ValueError):
    """The engine config does not fit this model or this machine."""


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError(f"device {requested!r} requested but CUDA is not available")
    return device


def expert_parallel_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """What expert parallelism changes: steps one at a time and eagerly. Each MoE layer exchanges rows whose counts
    the host reads, so neither overlapping the host with the next step nor CUDA graphs would hold; and a step's
    forward may have to be redone after a peer fails, before anything of it is sampled."""
    if device.type == "cuda" and config.num_kv_blocks is None:
        # Sizing the cache from free memory profiles a forward, which needs the group (its first epoch comes later).
        raise EngineConfigError("expert parallelism on CUDA needs num_kv_blocks: the KV cache is not profiled")
    return config.model_copy(update={"async_scheduling": False, "enforce_eager": True})


def warm_up_expert_parallel(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> None:
    """CUDA: compile the kernels of prefill and decode steps of several sizes before the group needs them. A Triton
    kernel compiled in the middle of a lockstep step holds every peer in its collective, past the group's deadline
    on a first start; the same shapes come from the disk cache afterwards."""
    state = runner.model.expert_parallel
    if state is None or runner.device.type != "cuda":
        return
    start = time.monotonic()
    with state.warm_up_alone(runner.device):
        runner.profile(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)  # the largest prefill
        for num_seqs in sorted({1, 2, 3, 16, 17, 32, 64, config.max_num_seqs}):
            if num_seqs <= config.max_num_seqs:
                runner.profile(num_seqs, num_seqs, max_model_len)  # a decode step of num_seqs sequences
    torch.cuda.synchronize(runner.device)
    log.info("expert parallelism: kernels warmed up in %.1fs", time.monotonic() - start)


def resolve_max_model_len(config: EngineConfig, model_limit: int) -> int:
    if config.max_model_len is None:
        return model_limit
    if config.max_model_len > model_limit:
        raise EngineConfigError(
            f"max_model_len {config.max_model_len} exceeds what the model supports ({model_limit} tokens)"
        )
    return config.max_model_len


def decide_num_kv_blocks(config: EngineConfig, runner: ModelRunner, max_model_len: int) -> int:
    """A fixed count if configured; on CUDA a share of the memory left after a profiled worst-case forward;
    on CPU from kv_cache_bytes (default 512 MiB)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    graph_pool_bytes = 0
    if runner.device.type == "cuda":
        step_peak = runner.profile(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
        if not config.enforce_eager:
            # By default the largest prompt graph is this very step: its profile is not run twice.
            same_step = config.prefill_graph_tokens == config.max_num_batched_tokens
            graph_pool_bytes = runner.estimate_graph_pool(
                config.max_num_seqs, max_model_len, config.prefill_graph_tokens, step_peak if same_step else None
            )
        num_bytes = gpu_kv_cache_bytes(runner.device, config.gpu_memory_fraction, graph_pool_bytes)
    else:
        num_bytes = config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = num_blocks_for_bytes(num_bytes, runner.bytes_per_block)
    if num_blocks < 1:
        graphs = f", after {graph_pool_bytes / 2**30:.2f} GiB held back for CUDA graphs" if graph_pool_bytes else ""
        raise ModelLoadError(
            f"no room for a single KV cache block ({runner.bytes_per_block} bytes) in {num_bytes} bytes{graphs}"
        )
    return num_blocks


def fit_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """A sequence must always fit the cache on its own (else preemption could never make room for it)."""
    capacity = num_blocks * config.block_size
    if capacity >= max_model_len:
        return max_model_len
    if config.max_model_len is not None:
        raise EngineConfigError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), less than "
            f"max_model_len {config.max_model_len}: give the cache more memory or lower max_model_len"
        )
    log.warning("max_model_len lowered from %d to %d tokens to fit the KV cache", max_model_len, capacity)
    return capacity
