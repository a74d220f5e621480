"""Tidal's engine on the workload: steady-state decode, the forward alone, time to first token, offline batch.

Every figure goes through `LLMEngine.step()`/`generate()` — scheduling, step plans, the (graphed) forward,
sampling and detokenization — since that is what a request pays. `forward_ms` times `ModelRunner.execute` alone on
a synthetic decode plan of the same shape, so the report can show how much of a step is host work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from perf.presets import Workload, random_prompts
from perf.timing import DecodeRun, OfflineRun, now, steady_ms_per_step
from tidal.worker.engine.config import EngineConfig, KVCacheDType, WeightDType
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.loader.model_loader import LoadedModel

log = logging.getLogger(__name__)

# The engine's own default, so that a benchmark measures the engine as it ships unless told otherwise.
DEFAULT_PREFILL_GRAPH_TOKENS: int = EngineConfig.model_fields["cuda_graph_prefill_tokens"].default

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def engine_config(
    model_dir: Path,
    loaded: LoadedModel,
    device: torch.device,
    workload: Workload,
    gpu_memory_fraction: float,
    async_scheduling: bool = True,
    kv_cache_dtype: KVCacheDType = "auto",
    weight_dtype: WeightDType = "auto",
    prefill_graph_tokens: int = DEFAULT_PREFILL_GRAPH_TOKENS,
) -> EngineConfig:
    """Every decode batch's prompts fit one step (so its rows decode in lock step), and no prefix cache: a
    repeated prompt must cost a full prefill every time. `prefill_graph_tokens`: the engine's
    cuda_graph_prefill_tokens (prompt steps of up to that many tokens replay CUDA graphs)."""
    return EngineConfig(
        model_path=model_dir,
        dtype=DTYPE_NAMES[loaded.dtype],
        device=str(device),
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=max(
            2048, max(workload.decode_batches) * workload.decode_prompt_len, workload.ttft_prompt_len
        ),
        enable_prefix_caching=False,
        gpu_memory_fraction=gpu_memory_fraction,
        async_scheduling=async_scheduling,
        kv_cache_dtype=kv_cache_dtype,
        weight_dtype=weight_dtype,
        cuda_graph_prefill_tokens=prefill_graph_tokens,
    )


def build_engine(config: EngineConfig, loaded: LoadedModel) -> tuple[LLMEngine, dict]:
    """-> the engine and its setup facts (KV cache size, captured batch sizes, seconds)."""
    start = time.monotonic()
    engine = LLMEngine.from_loaded_model(config, loaded)
    runner = engine.runner
    decode, prompt = runner.decode_graphs, runner.prefill_graphs
    facts = {
        "setup_seconds": time.monotonic() - start,
        "num_kv_blocks": runner.num_kv_blocks,
        "block_size": config.block_size,
        "kv_cache_bytes": runner.num_kv_blocks * runner.bytes_per_block,
        "kv_cache_tokens": runner.num_kv_blocks * config.block_size,
        "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "gpu_memory_fraction": config.gpu_memory_fraction if runner.device.type == "cuda" else None,
        "cuda_graph_batch_sizes": decode.sizes if decode is not None else [],
        "cuda_graph_prefill_tokens": prompt.sizes if prompt is not None else [],
        # Seconds of setup_seconds spent capturing (kernel compiles included: a cold cache costs most of them).
        "decode_graph_capture_seconds": decode.capture_seconds if decode is not None else None,
        "prompt_graph_capture_seconds": prompt.capture_seconds if prompt is not None else None,
        "cuda_graph_pool_gib": runner.graph_pool_bytes / 2**30,
        "cuda_graph_pool_estimate_gib": runner.graph_pool_estimate_bytes / 2**30,
        "async_scheduling": config.async_scheduling,
    }
    return engine, facts


def measure_decode(
    engine: LLMEngine,
    prompts: list[list[int]],
    new_tokens: int,
    warmup: int,
    params: list[SamplingParams] | None = None,
) -> DecodeRun:
    """`params`: one per prompt (default greedy); each row must generate exactly `new_tokens` (ignore_eos, no
    grammar that can end it), so that the rows decode in lock step."""
    rows = params or [SamplingParams(temperature=0.0, ignore_eos=True)] * len(prompts)
    # Untimed first, as on transformers' side: first calls of this batch's prefill shapes compile kernels.
    engine.generate(prompts, [p.model_copy(update={"max_tokens": min(4, new_tokens)}) for p in rows])
    ids = [f"decode-{len(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, rows, strict=True):
        engine.add_request(request_id, prompt, p.model_copy(update={"max_tokens": new_tokens}))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    marks: list[float] = []  # marks[k]: when every row had k + 1 tokens
    while engine.has_unfinished_requests():
        outputs = engine.step()  # a step's outputs come once the device is done with it (the next may be queued)
        stamp = time.perf_counter()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        slowest = min(len(t) for t in tokens.values())
        marks.extend([stamp] * (slowest - len(marks)))
    run = DecodeRun(
        batch=len(prompts),
        prompt_len=len(prompts[0]),
        new_tokens=new_tokens,
        timed_steps=new_tokens - warmup,
        ms_per_step=steady_ms_per_step(marks, warmup),
        outputs=[tokens[i] for i in ids],
    )
    run.forward_ms = forward_ms(engine, run.batch, run.prompt_len + (new_tokens + warmup) // 2)
    return run


def forward_ms(engine: LLMEngine, batch: int, context_len: int, iters: int = 20) -> float | None:
    """ms of `ModelRunner.execute` (inputs to logits, CUDA graph where one applies) for a decode step of `batch`
    sequences of `context_len` tokens, on cache blocks no request holds now. None if the cache is too small."""
    runner, block_size = engine.runner, engine.config.block_size
    blocks_per_seq = -(-context_len // block_size)
    if engine.has_unfinished_requests() or batch * blocks_per_seq > runner.num_kv_blocks:
        return None
    plan = decode_plan(batch, context_len, block_size, step_tokens(batch, runner.model.vocab_size))
    for _ in range(3):
        runner.execute(plan)
    start = now(runner.device)
    for _ in range(iters):
        runner.execute(plan)
    return (now(runner.device) - start) * 1000.0 / iters


def step_tokens(batch: int, vocab_size: int) -> list[int]:
    """One seeded random token per sequence: distinct tokens route to different experts, as real ones do (the
    same token in every row would make a MoE step read only top-k experts per layer)."""
    return random_prompts(1, batch, vocab_size, seed=4242 + batch)[0]


def decode_plan(batch: int, context_len: int, block_size: int, input_ids: list[int]) -> StepPlan:
    """A decode step of `batch` sequences of `context_len` tokens each, on blocks 0.. in order (no request holds
    them: the caller checks the cache is idle)."""
    blocks_per_seq = -(-context_len // block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    return StepPlan(
        seq_ids=list(range(batch)),
        input_ids=list(input_ids),
        positions=[context_len - 1] * batch,
        slot_mapping=[t[-1] * block_size + (context_len - 1) % block_size for t in tables],
        cu_seqlens_q=list(range(batch + 1)),
        seq_lens=[context_len] * batch,
        block_tables=tables,
        sample_indices=list(range(batch)),
        sample_seq_ids=list(range(batch)),
    )


def prefill_plan(input_ids: list[int], block_size: int) -> StepPlan:
    """A whole prompt as one sequence's first step, on blocks 0.. in order, sampling its last row (no request
    holds the blocks: the caller checks the cache is idle)."""
    prompt_len = len(input_ids)
    table = list(range(-(-prompt_len // block_size)))
    return StepPlan(
        seq_ids=[0],
        input_ids=list(input_ids),
        positions=list(range(prompt_len)),
        slot_mapping=[table[p // block_size] * block_size + p % block_size for p in range(prompt_len)],
        cu_seqlens_q=[0, prompt_len],
        seq_lens=[prompt_len],
        block_tables=[table],
        sample_indices=[prompt_len - 1],
        sample_seq_ids=[0],
    )


def measure_ttft(engine: LLMEngine, prompt: list[int], repeats: int) -> list[float]:
    """ms from add_request to the first token, `repeats` times after one untimed run."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        start = now(engine.runner.device)
        engine.add_request(f"ttft-{r}", prompt, params)
        while not any(out.new_token_ids for out in engine.step()):
            pass
        times.append((time.perf_counter() - start) * 1000.0)
    return times[1:]


def measure_offline(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, params: SamplingParams | None = None
) -> OfflineRun:
    """All prompts at once through `generate` with `params` (default greedy, ignore_eos), at most `output_len`
    tokens each; an untimed short run first compiles every prefill shape (and the request's grammar, if any)."""
    params = params or SamplingParams(temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params.model_copy(update={"max_tokens": min(4, output_len)}))
    params = params.model_copy(update={"max_tokens": output_len})
    start = now(engine.runner.device)
    results = engine.generate(prompts, params)
    seconds = now(engine.runner.device) - start
    run = OfflineRun(
        requests=len(prompts),
        input_len=len(prompts[0]),
        output_len=output_len,
        seconds=seconds,
        output_tokens=sum(len(r.output_token_ids) for r in results),
    )
    # The forward of a full decode step halfway through: set against the run's time, it shows the host's share.
    batch = min(len(prompts), engine.config.max_num_seqs)
    run.decode_forward_ms = forward_ms(engine, batch, run.input_len + output_len // 2)
    return run
