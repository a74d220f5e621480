"""Where a step's time goes on CUDA: kernels of a decode forward, the GEMMs alone, a prefill, and the offline run
step by step.

    python benchmarks/profile_steps.py --preset llama3-8b [--batches 1 32 256] [--offline] [--gemm] [--prefill 1024]

Prints, per decode batch size, each kernel's share of a graphed forward (torch.profiler; the sum set against the wall
time shows launch gaps) under the step's hardware bound (perf/step_bound.py: its bytes at the issue's copy bandwidth
against its FLOPs at the H200's dense bf16 peak, the FP8 peak for projections held in FP8, all from
perf/device.py; the larger binds); with --gemm, each linear layer's shape timed alone at M = the batch sizes
(distinct weight copies in turn, so L2 holds none of them, as in a real forward); with --prefill N, the forward of
one N-token prompt run eagerly (as the engine runs a prompt step larger than its graphs): the host's time to queue
it, its wall time and its kernels' busy time, so a host-bound prefill shows as kernels well under wall, and beside
it the same step replayed from its CUDA graph where the engine has one (--prefill-graph-tokens, by default the
engine's 2048; 0 for none); with --one-row-table FILE, the engine runs on the one-row tables a kernel sweep wrote
(perf/tuned_tables.py) instead of the source's, for the step A/B that decides an entry, and with --moe-sweep FILE
on the small-batch MoE configs a sweep found; with --offline, the
issue's offline workload step by step: how many steps of each kind, their device time, the host time around them
and, for a dense model, the sum of their bounds. Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import torch
import torch.nn.functional as F
from perf import moe, tuned_tables
from perf.device import H200_BF16_DENSE_TFLOPS, H200_FP8_DENSE_TFLOPS, ISSUE_COPY_TBS
from perf.engine_side import (
    DEFAULT_PREFILL_GRAPH_TOKENS,
    build_engine,
    decode_plan,
    engine_config,
    prefill_plan,
    step_tokens,
)
from perf.presets import PRESETS, default_workload, random_prompts, write_model_dir
from perf.random_model import build_random_model
from perf.step_bound import ModelShape, bound_line, decode_bound, step_bound
from perf.step_counts import model_shape
from perf.timing import kernel_times

from tidal.worker.engine.config import KVCacheDType, WeightDType
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.step_plan import StepPlan


def kernel_table(engine: LLMEngine, shape: ModelShape, batch: int, context_len: int, iters: int = 10) -> None:
    runner = engine.runner
    input_ids = step_tokens(batch, runner.model.vocab_size)
    # A MoE step reads only the experts its tokens route to: counted on this very step (same tokens, same context).
    touched = moe.touched_experts(engine, input_ids, context_len) if shape.top_k else []
    if touched is None:
        raise RuntimeError(f"batch {batch} x context {context_len} does not fit the KV cache")
    bound = decode_bound(
        shape, batch, context_len, sum(touched), ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS, H200_FP8_DENSE_TFLOPS
    )
    plan = decode_plan(batch, context_len, engine.config.block_size, input_ids)
    for _ in range(3):
        runner.execute(plan)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        runner.execute(plan)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6 / iters
    per_name = kernel_times(lambda: runner.execute(plan), iters)
    total = sum(sum(v) for v in per_name.values()) / iters
    print(f"\n## decode batch {batch}, context {context_len}: wall {wall_us:.0f} us/step, kernels {total:.0f} us/step")
    print(bound_line(bound, wall_us))
    print_kernels(per_name, iters, "us/step", 24)


def print_kernels(per_name: dict[str, list[float]], iters: int, unit: str, top: int) -> None:
    """The `top` kernels by time per call of what was profiled: us, share, launches and us per launch."""
    total = sum(sum(v) for v in per_name.values()) / iters
    print(f"{unit:>9} {'share':>6} {'calls':>6} {'us/call':>8}  kernel")
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        us, calls = sum(times) / iters, len(times) / iters
        print(f"{us:9.1f} {us / total:6.1%} {calls:6.0f} {us / calls:8.2f}  {name[:110]}")


def prefill_table(engine: LLMEngine, prompt_len: int, iters: int = 10) -> None:
    """A prompt's forward run eagerly (a prompt step larger than the graphs is): host queueing time, wall, and the
    kernels' busy time; then, where the engine has prompt-step CUDA graphs that hold it, the same step replayed."""
    runner = engine.runner
    prompt = random_prompts(1, prompt_len, runner.model.vocab_size, seed=7)[0]
    plan = prefill_plan(prompt, engine.config.block_size)
    graphs, runner.prefill_graphs = runner.prefill_graphs, None  # eager first, whatever the engine was built with
    try:
        wall, host, wall_ms = time_step(lambda: runner.execute(plan), iters)
        per_name = kernel_times(lambda: runner.execute(plan), iters)
    finally:
        runner.prefill_graphs = graphs
    kernels_ms = sum(sum(v) for v in per_name.values()) / iters / 1e3
    launches = sum(len(v) for v in per_name.values()) / iters
    print(f"\n## prefill of {prompt_len} tokens, one sequence, eager ({iters} runs, medians)")
    print(
        f"wall {wall:.2f} ms (runs {min(wall_ms):.2f}-{max(wall_ms):.2f}), host queueing {host:.2f} ms, kernels "
        f"{kernels_ms:.2f} ms busy ({kernels_ms / wall:.0%} of wall), {launches:.0f} kernels, "
        f"{host / launches * 1e3:.1f} us of host time per kernel"
    )
    print_kernels(per_name, iters, "us", 12)
    if graphs is not None and graphs.can_run(plan):
        graph_wall, graph_host, graph_ms = time_step(lambda: runner.execute(plan), iters)
        print(
            f"replayed from the {graphs.size_for(prompt_len)}-token CUDA graph: wall {graph_wall:.2f} ms (runs "
            f"{min(graph_ms):.2f}-{max(graph_ms):.2f}), host queueing {graph_host:.2f} ms; eager wall / graph wall "
            f"= {wall / graph_wall:.2f}x"
        )


def time_step(step: Callable[[], object], iters: int) -> tuple[float, float, list[float]]:
    """-> (median wall ms, median host ms to queue it, every wall ms) of `step`, after 3 untimed runs (compiles)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host_ms, wall_ms = [], []
    for _ in range(iters):
        start = time.perf_counter()
        step()  # only queues the work
        host_ms.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        wall_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(wall_ms), statistics.median(host_ms), wall_ms


def gemm_table(model: torch.nn.Module, batches: list[int]) -> None:
    """Each distinct linear shape at each M, through F.linear in a CUDA graph, against the bytes it must read."""
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n})
    print("\n## linear layers alone (CUDA graph of 20 calls on distinct weight copies)")
    print(f"{'out x in':>14} {'M':>4} {'us':>8} {'GB/s':>7} {'TFLOP/s':>8}")
    for out_f, in_f in shapes:
        copies = max(2, int(2e9 // (out_f * in_f * 2)))
        weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 20))]
        for m in batches:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            for w in weights:
                F.linear(x, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(20):
                    F.linear(x, weights[i % len(weights)])
            graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            us = (time.perf_counter() - start) * 1e6 / 100
            nbytes = out_f * in_f * 2 + m * (in_f + out_f) * 2
            print(
                f"{out_f:>6}x{in_f:<7} {m:>4} {us:8.1f} {nbytes / us / 1e3:7.0f} {2 * m * out_f * in_f / us / 1e6:8.1f}"
            )
        del weights


def offline_bound_us(shape: ModelShape, plan: StepPlan) -> float | None:
    """The step's hardware bound; None for a MoE model, whose graphed steps leave the experts touched uncounted."""
    if shape.top_k:
        return None
    cu = plan.cu_seqlens_q
    new_tokens = [b - a for a, b in itertools.pairwise(cu)]
    sampled = len(plan.sample_indices)
    bound = step_bound(
        shape, new_tokens, plan.seq_lens, sampled, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS, H200_FP8_DENSE_TFLOPS
    )
    return bound.bound_us


def offline_trace(
    engine: LLMEngine, shape: ModelShape, requests: int, input_len: int, output_len: int, vocab: int
) -> None:
    runner = engine.runner
    prompts = random_prompts(requests, input_len, vocab, seed=99)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    records: list[tuple[int, int, bool, float]] = []  # (tokens, seqs, decode-only, device ms)
    plans: list[StepPlan] = []  # their bounds are worked out after the run, off the timed steps
    execute = runner.execute

    def timed_execute(plan: StepPlan, *args: torch.Tensor | None) -> torch.Tensor | None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = execute(plan, *args)
        torch.cuda.synchronize()
        records.append((plan.num_tokens, plan.num_seqs, plan.is_decode_only, (time.perf_counter() - start) * 1e3))
        plans.append(plan)
        return out

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"trace-{i}", prompt, params)
    step_ms: list[float] = []
    # One step per step() call, each synchronised: an overlapped step() would launch one step and read another.
    engine.config = engine.config.model_copy(update={"async_scheduling": False})
    runner.execute = timed_execute  # type: ignore[method-assign]
    try:
        start_all = time.perf_counter()
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - start) * 1e3)
        total = time.perf_counter() - start_all
    finally:
        runner.execute = execute  # type: ignore[method-assign]
    kinds: dict[str, list[tuple[float, float, int, float | None]]] = collections.defaultdict(list)
    for (tokens, _seqs, decode_only, dev_ms), wall, plan in zip(records, step_ms, plans, strict=True):
        kind = "decode only" if decode_only else "with prefill"
        kinds[kind].append((dev_ms, wall - dev_ms, tokens, offline_bound_us(shape, plan)))
    print(f"\n## offline {requests} x ({input_len} in, {output_len} out): {total:.2f} s (synchronised steps)")
    figures = f"bytes at {ISSUE_COPY_TBS:g} TB/s, FLOPs at {H200_BF16_DENSE_TFLOPS:g} TFLOP/s"
    if shape.fp8_matmul_params:
        figures += f" (through FP8 weights at {H200_FP8_DENSE_TFLOPS:g})"
    print(f"bound: each step's max({figures}), summed over the steps of a kind")
    print(
        f"{'kind':>15} {'steps':>6} {'device s':>9} {'host s':>7} {'tokens':>8} {'ms/step dev':>11} "
        f"{'bound s':>8} {'dev / bound':>11}"
    )
    for kind, rows in kinds.items():
        dev = sum(r[0] for r in rows) / 1e3
        host = sum(r[1] for r in rows) / 1e3
        tokens = sum(r[2] for r in rows)
        bounds = [r[3] for r in rows]
        if any(b is None for b in bounds):  # a MoE model: see offline_bound_us
            bound_cols = f"{'-':>8} {'-':>11}"
        else:
            bound_s = sum(b for b in bounds if b is not None) / 1e6
            bound_cols = f"{bound_s:8.3f} {dev / bound_s:10.2f}x"
        print(
            f"{kind:>15} {len(rows):6d} {dev:9.3f} {host:7.3f} {tokens:8d} {dev * 1e3 / len(rows):11.2f} {bound_cols}"
        )
    first = records[:12]
    print("first steps (tokens, seqs, decode-only, device ms):", [(t, s, d, round(ms, 2)) for t, s, d, ms in first])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 32, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10, help="decode steps timed a batch (wall and kernels)")
    parser.add_argument("--gemm", action="store_true")
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--prefill", type=int, nargs="*", default=[], metavar="TOKENS")
    parser.add_argument("--kv-cache-dtype", choices=get_args(KVCacheDType), default="auto")
    parser.add_argument("--weight-dtype", choices=get_args(WeightDType), default="auto")
    parser.add_argument(
        "--prefill-graph-tokens", type=int, default=DEFAULT_PREFILL_GRAPH_TOKENS, metavar="TOKENS",
        help="the engine's prompt-step CUDA graphs (0: none); --prefill then times their replay beside eager",
    )  # fmt: skip
    parser.add_argument(
        "--one-row-table", type=Path, metavar="FILE",
        help="run on the one-row tables in FILE (probe_row_gemv.py --write-table) instead of the source's",
    )  # fmt: skip
    parser.add_argument(
        "--moe-sweep", type=Path, metavar="FILE",
        help="run on the small-batch MoE configs a sweep_moe_small_batch.py --out file found, for its token counts",
    )  # fmt: skip
    args = parser.parse_args()
    if args.one_row_table is not None:
        print(f"one-row tables from {args.one_row_table}: {tuned_tables.install(args.one_row_table)}")
    if args.moe_sweep is not None:
        print(f"small-batch MoE configs from {args.moe_sweep}: {tuned_tables.install_moe_sweep(args.moe_sweep)}")
    device = torch.device("cuda:0")
    preset = PRESETS[args.preset]
    workload = default_workload(preset, "cuda", smoke=False)
    with tempfile.TemporaryDirectory(prefix="tidal-profile-") as tmp:
        model_dir = write_model_dir(preset, Path(tmp) / preset.name)
        loaded = build_random_model(model_dir, torch.bfloat16, device, seed=0, weight_dtype=args.weight_dtype)
        config = engine_config(
            model_dir, loaded, device, workload, 0.9, kv_cache_dtype=args.kv_cache_dtype,
            weight_dtype=args.weight_dtype, prefill_graph_tokens=args.prefill_graph_tokens,
        )  # fmt: skip
        step_tokens_max = config.max_num_batched_tokens
        if any(not 0 < n <= step_tokens_max for n in args.prefill):
            parser.error(f"--prefill takes 1 to {step_tokens_max} tokens (one step of this preset), got {args.prefill}")
        engine, facts = build_engine(config, loaded)
        print(f"engine: {facts}", flush=True)
        shape = model_shape(loaded.model, loaded.hf_config, engine.runner.kv_cache_dtype)
        for batch in args.batches:
            kernel_table(engine, shape, batch, args.context, args.iters)
        for prompt_len in args.prefill:
            prefill_table(engine, prompt_len)
        if args.offline:
            offline_trace(
                engine,
                shape,
                workload.offline_requests,
                workload.offline_input_len,
                workload.offline_output_len,
                loaded.model.vocab_size,
            )
        if args.gemm:
            gemm_table(loaded.model, args.batches)


if __name__ == "__main__":
    main()
