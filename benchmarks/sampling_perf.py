"""What sampling features cost the engine: batch decode with logprobs, penalties and logit biases on half the rows,
and offline throughput with every request under a JSON schema, each against the same run without them; and the
plain runs against gpu_perf.py's recorded figures. Writes JSON + markdown.

    python benchmarks/sampling_perf.py --preset llama3-8b --device cuda     # the issue's run (H200)
    python benchmarks/sampling_perf.py --preset tiny --device cpu [--smoke] # the same run on a CPU, in seconds

The engine, weights and prompts are gpu_perf's (random weights drawn on the device, its engine configuration, its
seeded prompts), so the all-greedy decode and the plain offline batch repeat its measurements. The structured
requests go through the engine's own path (the compiled grammar's matcher masks each step's logits, and steps run
one at a time while such a request is live) over a vocabulary of the model's size (perf/grammar_vocab.py).
Results: benchmarks/results/sampling-perf-<preset>-<gpu|cpu>[-smoke].{json,md}, rewritten after each phase.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from perf import device as devinfo
from perf import engine_side, grammar_vocab, sampling_report, sampling_side
from perf.cli import DTYPES, RESULTS, engine_benchmark_parser, parse_checked, progress
from perf.presets import PRESETS, random_prompts, write_model_dir
from perf.random_model import build_random_model
from perf.report import result_stem

from tidal.worker.engine.structured_output import StructuredOutput


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = engine_benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--recorded", type=Path, default=None, help="gpu_perf report to compare with (default: its file in results/)"
    )
    return parse_checked(parser, argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    grammar_vocab.require_xgrammar()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("tidal.worker.loader").setLevel(logging.WARNING)  # one line per tensor otherwise
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    preset = PRESETS[args.preset]
    workload = sampling_side.workload_for(device.type, args.smoke)
    env = devinfo.environment(device)
    progress(f"{env}")
    gpu_stem = result_stem(preset.name, env, args.smoke)
    recorded_path = args.recorded or RESULTS / f"{result_stem(preset.name, env, False)}.json"
    report: dict[str, Any] = {
        "benchmark": "benchmarks/sampling_perf.py",
        "preset": preset.name,
        "smoke": args.smoke,
        "environment": env,
        "workload": workload.model_dump(),
        "features": {k: str(v) for k, v in sampling_side.FEATURES.items()},
        "decode": {"greedy": [], "plain": [], "featured": []},
        "offline": {},
        "recorded": sampling_report.recorded_figures(recorded_path, workload.decode_batch),
    }
    stem = "sampling-" + gpu_stem
    judged = device.type == "cuda" and not args.smoke

    def save() -> None:
        report["ratios"] = sampling_report.ratios(report)
        report["targets"] = sampling_report.targets(report, judged)
        sampling_report.write_report(report, args.out, stem)

    with tempfile.TemporaryDirectory(prefix="tidal-sampling-perf-") as tmp:
        model_dir = write_model_dir(preset, Path(tmp) / preset.name)
        loaded = build_random_model(model_dir, dtype, device, args.seed)
        vocab = loaded.model.vocab_size
        report["model"] = {"dtype": str(dtype).removeprefix("torch."), "vocab_size": vocab, "seed": args.seed}
        progress(f"random {preset.name} weights: {loaded.report.num_bytes / 1e9:.2f} GB")
        config = engine_side.engine_config(
            model_dir, loaded, device, workload.engine_workload(), args.gpu_memory_fraction
        )
        engine, report["engine_setup"] = engine_side.build_engine(config, loaded)
        progress(f"engine ready: {report['engine_setup']}")
        grammars = grammar_vocab.install(engine)

        batch = workload.decode_batch
        prompts = random_prompts(batch, workload.decode_prompt_len, vocab, seed=1000 + batch)  # gpu_perf's prompts
        mixes = sampling_side.decode_mixes(batch)
        for repeat in range(workload.decode_repeats):
            for mix, params in mixes.items():
                run = engine_side.measure_decode(
                    engine, prompts, workload.decode_new_tokens, workload.decode_warmup_tokens, params
                )
                report["decode"][mix].append(run.figures())
                progress(f"decode {mix} (run {repeat + 1}): {run.ms_per_step:.3f} ms/step")
                save()

        schema = sampling_side.long_json_schema(workload.offline_output_len)
        spec = StructuredOutput.json_schema(schema)  # as the server reads response_format's json_schema (strict)
        start = time.monotonic()
        grammars.compile(spec)  # untimed: a server compiles off the step loop, once per schema
        structured = sampling_side.structured(spec)
        report["grammar"] = {
            "vocab_size": vocab,
            "synthetic_tokens": grammars.num_synthetic_tokens,
            "compile_seconds": time.monotonic() - start,  # the vocabulary's setup included (first use)
            "schema": schema,
        }
        prompts = random_prompts(workload.offline_requests, workload.offline_input_len, vocab, seed=99)
        for mix, params in (("plain", sampling_side.greedy()), ("structured", structured)):
            run = engine_side.measure_offline(engine, prompts, workload.offline_output_len, params)
            report["offline"][mix] = {**run.figures(), "mean_output_tokens": run.output_tokens / run.requests}
            progress(
                f"offline {mix}: {report['offline'][mix]['output_tokens_per_s']:.0f} output tokens/s, "
                f"{report['offline'][mix]['mean_output_tokens']:.1f} tokens per request"
            )
            save()
        grammars.shutdown()
    print(sampling_report.to_markdown(report), flush=True)
    progress(f"wrote {args.out / stem}.json and .md")
    return report


if __name__ == "__main__":
    main()
