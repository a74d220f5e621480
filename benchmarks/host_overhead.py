"""Host (CPU) time per engine step, split by phase, on a tiny real model running on the CPU.

    python benchmarks/host_overhead.py [--batches 1,32,256] [--new-tokens 64] [--profile 256]

On a GPU the forward of a graphed decode step runs while the host is idle, so whatever the engine does in
Python around it adds straight to the step time. This measures that part without a GPU: the engine runs for
real (scheduler, step plan, input tensors, sampler, detokenizer, outputs) around a tiny model, and the time
spent inside the model's forward and logits (the "device" work, which a GPU would do) is subtracted from each
step's wall time. Only decode-only steps are counted (the steady state of a long generation). With --device cuda
the same engine runs its tiny forward on a GPU (CUDA graphs): there the host's wait for the GPU after the
forward was launched is the device time, so the table is the host time of the real decode path.

Phases: schedule (Scheduler.schedule), plan (build_step_plan), prep (ModelRunner.execute minus the model's
forward and logits: building input tensors), sample (Sampler.sample_on_device, argmax included), advance
(Scheduler.on_step_launched and commit; on_step_done in older engines), detok (the batched detokenization of a
step, where the engine has one: older engines detokenize inside `outputs`), outputs (the rest of LLMEngine.step:
reading the sampled tokens, stop checks, RequestOutput objects).

With async scheduling (the default; --no-async-scheduling turns it off) a step() launches one step and reads the
one before: the phases are those of one call either way. On a CPU nothing overlaps (the forward runs inside the
call), and with --device cuda the wait after execute makes the GPU's work part of the call too, so the table is
the host's work per step in both modes, not the overlap (benchmarks/perf measures that on a GPU).

The printed digest covers every request's token ids and text, so two versions of the engine can be checked
for identical outputs by comparing it.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.worker.engine import llm_engine as llm_engine_module
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.tiny_models import write_tiny_model

PHASES = ("schedule", "plan", "prep", "sample", "advance", "detok", "outputs")


@dataclass
class StepTimes:
    """Seconds spent in each phase during the current step (reset by the caller)."""

    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    device: float = 0.0
    is_decode_only: bool = False


def _timed(times: StepTimes, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.phases[phase] += time.perf_counter() - start

    return wrapper


def _device_timed(times: StepTimes, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.device += time.perf_counter() - start

    return wrapper


def _instrument(engine: LLMEngine, times: StepTimes) -> Callable[[], None]:
    """Wrap the engine's parts with timers; -> a function that undoes it."""
    original_plan = llm_engine_module.build_step_plan

    def plan_and_note(*args: Any, **kwargs: Any) -> Any:
        plan = original_plan(*args, **kwargs)
        times.is_decode_only = plan.is_decode_only
        return plan

    llm_engine_module.build_step_plan = _timed(times, "plan", plan_and_note)  # type: ignore[attr-defined]
    original_push_each = getattr(llm_engine_module, "push_each", None)
    if original_push_each is not None:
        llm_engine_module.push_each = _timed(times, "detok", original_push_each)  # type: ignore[attr-defined]
    engine.scheduler.schedule = _timed(times, "schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    sampler, scheduler = engine.sampler, engine.scheduler
    # The names of today's engine first, then those of older ones (the table compares versions).
    sample_name = "sample_on_device" if hasattr(sampler, "sample_on_device") else "sample"
    setattr(sampler, sample_name, _timed(times, "sample", getattr(sampler, sample_name)))
    advance_names = ("on_step_launched", "commit") if hasattr(scheduler, "on_step_launched") else ("on_step_done",)
    for name in advance_names:
        setattr(scheduler, name, _timed(times, "advance", getattr(scheduler, name)))
    if engine.runner.device.type == "cuda":
        # The forward runs on the GPU (replayed graphs): execute only launches it. What the host then waits for
        # is the device time; the launch itself stays in prep.
        execute = engine.runner.execute

        def execute_then_wait(*args: Any, **kwargs: Any) -> Any:
            out = execute(*args, **kwargs)
            _device_timed(times, torch.cuda.synchronize)()
            return out

        engine.runner.execute = execute_then_wait  # type: ignore[method-assign]
    else:
        model = engine.runner.model
        model.forward = _device_timed(times, model.forward)  # type: ignore[method-assign]
        model.compute_logits = _device_timed(times, model.compute_logits)  # type: ignore[method-assign]
    engine.runner.execute = _timed(times, "prep", engine.runner.execute)  # type: ignore[method-assign]

    def undo() -> None:
        llm_engine_module.build_step_plan = original_plan  # type: ignore[attr-defined]
        if original_push_each is not None:
            llm_engine_module.push_each = original_push_each  # type: ignore[attr-defined]

    return undo


@dataclass
class Result:
    batch: int
    num_steps: int
    step_ms: float
    device_ms: float
    host_ms: float
    phase_ms: dict[str, float]
    digest: str


def _build_engine(
    model_dir: Path, batch: int, prompt_len: int, new_tokens: int, device: str, async_scheduling: bool
) -> LLMEngine:
    block_size = 16
    blocks_per_seq = -(-(prompt_len + new_tokens) // block_size) + 1
    extra = {"async_scheduling": async_scheduling} if "async_scheduling" in EngineConfig.model_fields else {}
    config = EngineConfig(
        model_path=model_dir,
        device=device,
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=batch * blocks_per_seq + 8,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * prompt_len),
        enable_prefix_caching=True,
        **extra,
    )
    return LLMEngine.from_config(config)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def run_batch(
    engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, profiler: cProfile.Profile | None
) -> Result:
    vocab = min(engine.vocab_size, len(engine.tokenizer))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"r{i}", prompt, params)
    times = StepTimes()
    undo = _instrument(engine, times)
    tokens: dict[str, list[int]] = defaultdict(list)
    texts: dict[str, list[str]] = defaultdict(list)
    step_s: list[float] = []
    device_s: list[float] = []
    phase_s: dict[str, list[float]] = defaultdict(list)
    try:
        while engine.has_unfinished_requests():
            times.phases.clear()
            times.device = 0.0
            times.is_decode_only = False
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()
            for out in outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
            if not times.is_decode_only:
                continue
            step_s.append(elapsed)
            device_s.append(times.device)
            # execute's own time includes the forward: keep only its host part.
            phases = dict(times.phases)
            phases["prep"] = phases.get("prep", 0.0) - times.device
            phases["outputs"] = elapsed - sum(phases.values()) - times.device
            for name in PHASES:
                phase_s[name].append(phases.get(name, 0.0))
    finally:
        undo()
    digest = hashlib.sha256()
    for request_id in sorted(tokens, key=lambda r: int(r[1:])):
        digest.update(repr((tokens[request_id], "".join(texts[request_id]))).encode())
    host_s = [s - d for s, d in zip(step_s, device_s, strict=True)]
    return Result(
        batch=batch,
        num_steps=len(step_s),
        step_ms=statistics.median(step_s) * 1e3,
        device_ms=statistics.median(device_s) * 1e3,
        host_ms=statistics.median(host_s) * 1e3,
        phase_ms={name: statistics.median(values) * 1e3 for name, values in phase_s.items()},
        digest=digest.hexdigest()[:16],
    )


def print_table(results: list[Result]) -> None:
    head = f"{'batch':>5} {'steps':>5} {'step':>8} {'device':>8} {'host':>8} " + " ".join(f"{p:>8}" for p in PHASES)
    print("median ms per decode-only step (host = step - device)")
    print(head + "  digest")
    for r in results:
        phases = " ".join(f"{r.phase_ms.get(p, 0.0):8.3f}" for p in PHASES)
        print(
            f"{r.batch:5d} {r.num_steps:5d} {r.step_ms:8.3f} {r.device_ms:8.3f} {r.host_ms:8.3f} {phases}  {r.digest}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a model directory (default: write a tiny llama3)")
    parser.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the forward on a GPU, with CUDA graphs"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for the tiny forward")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="one step at a time (EngineConfig.async_scheduling off)"
    )
    parser.add_argument("--profile", type=int, default=0, help="cProfile the steps of this batch size")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or write_tiny_model("llama3", Path(tmp) / "llama3")
        results = []
        for batch in batches:
            engine = _build_engine(
                model_dir, batch, args.prompt_len, args.new_tokens, args.device, not args.no_async_scheduling
            )
            profiler = cProfile.Profile() if batch == args.profile else None
            results.append(run_batch(engine, batch, args.prompt_len, args.new_tokens, profiler))
            if profiler is not None:
                stats = pstats.Stats(profiler, stream=sys.stdout)
                stats.sort_stats("tottime").print_stats(30)
    print(f"async scheduling: {'off' if args.no_async_scheduling else 'on'}")
    print_table(results)


if __name__ == "__main__":
    main()
