"""Tidal's engine vs transformers' generate() on one device: decode, time to first token, offline throughput,
the batch-1 decode against the memory-bandwidth bound, and greedy agreement. Writes JSON + markdown.

    python benchmarks/gpu_perf.py --preset llama3-8b --device cuda      # the issue's run (~3-4 min on an H200)
    python benchmarks/gpu_perf.py --preset tiny --device cpu [--smoke]  # the same run on a CPU, in seconds
    python benchmarks/gpu_perf.py --preset qwen3-30b-a3b --device cuda  # MoE: decode to batch 256, experts counted

A MoE preset's bound counts the bytes a step reads (dense weights, the experts its tokens touch, the KV cache:
perf/moe.py) instead of every weight. Its decode steps with few (token, k) pairs take the small-batch MoE path by
themselves (kernels/fused_moe_small_batch.py); `--moe-path grouped` keeps every batch on the grouped GEMMs (it sets
TIDAL_MOE_SMALL_BATCH=0; results then go to perf-<preset>-<gpu>-grouped.*), and `--moe-ab` times the decode batches
once more on the grouped GEMMs after the engine's run, in the same process (`moe_ab` in the JSON):

    python benchmarks/gpu_perf.py --preset qwen3-30b-a3b --device cuda --skip-transformers --moe-ab

Both sides run the same random weights (drawn on the device, no checkpoint on disk), the same prompts, greedy,
exactly N new tokens per row. Results: benchmarks/results/perf-<preset>-<gpu|cpu>[-smoke].{json,md}; the JSON is
rewritten after each phase, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from perf import device as devinfo
from perf import engine_side, moe, transformers_side
from perf.cli import DTYPES, engine_benchmark_parser, parse_checked, progress
from perf.presets import PRESETS, Workload, default_workload, random_prompts, write_model_dir
from perf.random_model import build_random_model
from perf.report import (
    agreement,
    bandwidth_bound,
    comparison,
    prefill_graphs_stem,
    result_stem,
    targets,
    to_markdown,
    write_report,
)
from perf.timing import kernel_busy_ms, median

from tidal.worker.loader.model_loader import LoadedModel

SMALL_BATCH_SWITCH = "TIDAL_MOE_SMALL_BATCH"  # kernels/fused_moe.py: "0" keeps every MoE batch on the grouped GEMMs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = engine_benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--skip-transformers", action="store_true", help="only the engine (no baseline, no ratios)")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="the engine one step at a time (no host/device overlap)"
    )
    parser.add_argument(
        "--moe-path", choices=["auto", "grouped"], default="auto", help="grouped: no small-batch MoE path (A/B)"
    )
    parser.add_argument("--moe-ab", action="store_true", help="decode again on the grouped MoE path, same process")
    parser.add_argument(
        "--prefill-graph-tokens", type=int, default=engine_side.DEFAULT_PREFILL_GRAPH_TOKENS, metavar="TOKENS",
        help="prompt steps of up to TOKENS tokens replay CUDA graphs (the engine's cuda_graph_prefill_tokens; 0: none)",
    )  # fmt: skip
    return parse_checked(parser, argv)


def run_side(
    name: str,
    side: ModuleType,
    target: Any,
    batches: list[int],
    workload: Workload,
    vocab: int,
    out: dict[str, Any],
    outputs: dict[int, list[list[int]]],
    save: Callable[[], None],
    device: torch.device,
) -> None:
    """The workload on one implementation (`side`: engine_side or transformers_side, `target` what it drives).
    Figures land in `out`, decode tokens in `outputs`; the report is saved after each measurement, so a run cut
    short keeps what it measured."""
    for batch in batches:
        prompts = random_prompts(batch, workload.decode_prompt_len, vocab, seed=1000 + batch)
        run = side.measure_decode(target, prompts, workload.decode_new_tokens, workload.decode_warmup_tokens)
        out["decode"].append(run.figures())
        outputs[batch] = run.outputs
        forward = f" (forward alone {run.forward_ms:.3f} ms)" if run.forward_ms else ""
        progress(
            f"{name} decode batch {batch}: {run.ms_per_step:.3f} ms/step, {run.tokens_per_s:.1f} tokens/s{forward}"
        )
        save()
    prompt = random_prompts(1, workload.ttft_prompt_len, vocab, seed=7)[0]
    times = side.measure_ttft(target, prompt, workload.ttft_repeats)
    # The prompt's kernel time beside its wall time: a MoE prefill runs eager, and its wall time can be the host's
    # (benchmarks/results/fp8-weights-h200.md), which moves from machine to machine while the kernels' does not.
    busy = kernel_busy_ms(lambda: side.measure_ttft(target, prompt, 0), device)
    out["ttft_ms"] = {"median": median(times), "runs": times, "kernels_busy_ms": busy}
    busy_note = f" (kernels busy {busy:.2f} ms)" if busy is not None else ""
    progress(f"{name} TTFT ({workload.ttft_prompt_len}-token prompt): {median(times):.2f} ms{busy_note}")
    save()
    prompts = random_prompts(workload.offline_requests, workload.offline_input_len, vocab, seed=99)
    out["offline"] = offline = side.measure_offline(target, prompts, workload.offline_output_len).figures()
    forward = offline["decode_forward_ms"]
    progress(
        f"{name} offline: {offline['output_tokens_per_s']:.0f} output tokens/s in {offline['seconds']:.2f} s"
        + (f" (forward of one full-batch decode step {forward:.3f} ms)" if forward else "")
    )
    save()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # The engine logs its memory sizing (free memory after the profiling run, the KV cache's share) at INFO.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("tidal.worker.loader").setLevel(logging.WARNING)  # one line per tensor otherwise
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    preset = PRESETS[args.preset]
    workload = default_workload(preset, device.type, args.smoke)
    env = devinfo.environment(device)
    progress(f"{env}")
    report: dict[str, Any] = {
        "benchmark": "benchmarks/gpu_perf.py",
        "preset": preset.name,
        "smoke": args.smoke,
        "environment": env,
        "workload": workload.model_dump(),
        "engine": {"decode": []},
        "transformers": None if args.skip_transformers else {"decode": []},
        "comparison": {},
    }
    if args.moe_path == "grouped":
        os.environ[SMALL_BATCH_SWITCH] = "0"  # read by fused_moe at each call, so also at graph capture
        report["moe_path"] = "grouped"
    stem = result_stem(preset.name, env, args.smoke) + ("-grouped" if args.moe_path == "grouped" else "")
    stem += "" if args.kv_cache_dtype == "auto" else "-kv-fp8"  # never over the bf16 cache's record
    stem += "" if args.weight_dtype == "auto" else "-w-fp8"
    stem += prefill_graphs_stem(args.prefill_graph_tokens, engine_side.DEFAULT_PREFILL_GRAPH_TOKENS)
    outputs: dict[str, dict[int, list[list[int]]]] = {"tidal": {}, "transformers": {}}

    def save() -> None:
        ours = report["engine"].get("decode", [])
        b1 = next((d["ms_per_step"] for d in ours if d["batch"] == 1), None)
        measured = report.get("ceilings", {}).get("device_copy_tbs")
        # A MoE step reads the dense weights and top-k experts per layer, not every weight (perf/moe.py).
        step_bytes = report["moe"]["batch1_bytes"] if report.get("moe") else report["model"]["weight_bytes"]
        report["bandwidth"] = bandwidth_bound(step_bytes, b1, devinfo.ISSUE_COPY_TBS, measured)
        if report.get("moe"):
            report["moe"]["per_batch"] = moe_bounds(report["moe"], report["engine"], devinfo.ISSUE_COPY_TBS)
        report["comparison"] = comparison(report["engine"], report["transformers"])
        if not args.skip_transformers:
            report["agreement"] = agreement(outputs["tidal"], outputs["transformers"])
        report["targets"] = targets(preset.name, device.type, report)
        write_report(report, args.out, stem)

    with tempfile.TemporaryDirectory(prefix="tidal-perf-") as tmp:
        model_dir = write_model_dir(preset, Path(tmp) / preset.name)
        loaded = build_random_model(model_dir, dtype, device, args.seed, args.weight_dtype)
        report["model"] = model_facts(loaded, args.seed)
        step = moe.step_bytes(loaded.model)
        if step is not None:
            report["moe"] = {**asdict(step), "batch1_bytes": step.batch1_bytes, "touched": [], "per_batch": []}
        progress(
            f"random {preset.name} weights: {loaded.report.num_bytes / 1e9:.2f} GB in {loaded.report.seconds:.1f} s"
        )
        if device.type == "cuda":
            report["ceilings"] = devinfo.measure_bandwidths(device)
            progress(f"ceilings: {report['ceilings']}")

        config = engine_side.engine_config(
            model_dir, loaded, device, workload, args.gpu_memory_fraction, not args.no_async_scheduling,
            args.kv_cache_dtype, args.weight_dtype, args.prefill_graph_tokens,
        )  # fmt: skip
        engine, report["engine"]["setup"] = engine_side.build_engine(config, loaded)
        if device.type == "cuda":
            report["engine"]["memory_after_setup"] = devinfo.memory_gib(device)
        progress(f"engine ready: {report['engine']['setup']}")
        vocab = loaded.model.vocab_size
        ours = report["engine"]
        run_side(
            "tidal", engine_side, engine, workload.decode_batches, workload, vocab, ours, outputs["tidal"], save, device
        )
        if report.get("moe"):
            count_touched_experts(engine, workload, vocab, report["moe"])
            save()
        del engine  # frees the KV cache and the graphs' pool; the weights stay (transformers copies them)
        gc.collect()
        if args.moe_ab and report.get("moe") and args.moe_path == "auto":
            report["moe_ab"] = decode_on_grouped_path(config, loaded, workload, vocab)
            save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            report["engine"]["memory_after_teardown"] = devinfo.memory_gib(device)
            progress(f"engine released: {report['engine']['memory_after_teardown']}")

        if not args.skip_transformers:
            hf = report["transformers"]
            try:
                start = time.monotonic()
                model = transformers_side.load_transformers_model(loaded, device)
                hf["load_seconds"] = time.monotonic() - start
                hf["attn_implementation"] = model.config._attn_implementation
                progress(f"transformers loaded in {hf['load_seconds']:.1f} s ({hf['attn_implementation']} attention)")
                batches = workload.transformers_decode_batches
                theirs = outputs["transformers"]
                run_side("transformers", transformers_side, model, batches, workload, vocab, hf, theirs, save, device)
            except Exception as err:  # the engine's figures are worth writing even if the baseline breaks
                traceback.print_exc()
                hf["error"] = f"{type(err).__name__}: {err}"
        save()
    print(to_markdown(report), flush=True)
    progress(f"wrote {args.out / stem}.json and .md")
    return report


def decode_on_grouped_path(config: Any, loaded: LoadedModel, workload: Workload, vocab: int) -> dict[str, Any]:
    """The decode batches again on an engine whose MoE layers never take the small-batch path (graphs captured with
    the switch off), beside the first run's figures: the A/B of the small-batch MoE path in one process."""
    os.environ[SMALL_BATCH_SWITCH] = "0"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the first engine's blocks back to the device, so this one sizes its cache alike
    try:
        engine, setup = engine_side.build_engine(config, loaded)
        rows = []
        for batch in workload.decode_batches:
            prompts = random_prompts(batch, workload.decode_prompt_len, vocab, seed=1000 + batch)
            run = engine_side.measure_decode(engine, prompts, workload.decode_new_tokens, workload.decode_warmup_tokens)
            rows.append(run.figures())
            progress(f"tidal, grouped MoE path: decode batch {batch}: {run.ms_per_step:.3f} ms/step")
        del engine
        gc.collect()
    finally:
        os.environ.pop(SMALL_BATCH_SWITCH, None)
    return {"grouped_decode": rows, "grouped_setup": setup}


def count_touched_experts(engine: Any, workload: Workload, vocab: int, facts: dict[str, Any]) -> None:
    """Per decode batch, the experts each layer's router picks on one step of that batch (perf/moe.py)."""
    context_len = workload.decode_prompt_len + (workload.decode_new_tokens + workload.decode_warmup_tokens) // 2
    kv_per_token = engine.runner.bytes_per_block // engine.config.block_size
    for batch in workload.decode_batches:
        touched = moe.touched_experts(engine, engine_side.step_tokens(batch, vocab), context_len)
        if touched is None:
            progress(f"experts touched at batch {batch}: not counted (the KV cache is busy or too small)")
            continue
        facts["touched"].append({"batch": batch, "context_len": context_len, "per_layer": touched,
                                 "kv_bytes_per_token": kv_per_token})  # fmt: skip
        progress(f"batch {batch}: {sum(touched) / len(touched):.1f} experts touched per layer (of {len(touched)})")


def moe_bounds(facts: dict[str, Any], engine: dict[str, Any], copy_tbs: float) -> list[dict[str, Any]]:
    step = moe.StepBytes(
        facts["dense_bytes"], facts["expert_bytes"], facts["experts_per_layer"], facts["top_k"], facts["layers"]
    )
    decode = {d["batch"]: d for d in engine.get("decode", [])}
    rows = []
    for t in facts["touched"]:
        bound = moe.batch_bound(step, t["per_layer"], t["kv_bytes_per_token"], t["batch"], t["context_len"])
        measured = decode.get(t["batch"], {})
        rows.append(moe.with_times(bound, copy_tbs, measured.get("ms_per_step"), measured.get("forward_ms")))
    return rows


def model_facts(loaded: LoadedModel, seed: int) -> dict[str, Any]:
    return {
        "architecture": loaded.hf_config.architectures[0],
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "num_parameters": sum(p.numel() for p in loaded.model.parameters()),
        "weight_bytes": loaded.report.num_bytes,
        "vocab_size": loaded.model.vocab_size,
        "seed": seed,
        "random_weights_seconds": loaded.report.seconds,
    }


if __name__ == "__main__":
    main()
