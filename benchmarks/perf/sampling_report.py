"""benchmarks/sampling_perf.py's derived figures (ratios against the plain runs and the recorded gpu_perf run),
its targets, and its markdown. Pure: plain data in, plain data out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from perf.report import _f, _target
from perf.timing import median

MAX_FEATURE_COST = 1.10  # the issue: featured decode steps and structured throughput within 10% of plain ones
MAX_DRIFT = 1.05  # plain now vs the recorded gpu_perf run: slower than this is more than run-to-run noise


def recorded_figures(path: Path, batch: int) -> dict[str, Any] | None:
    """gpu_perf's decode ms/step at `batch` and offline output tokens/s from its report at `path` (None if absent)."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    engine = report.get("engine") or {}
    decode = next((d for d in engine.get("decode", []) if d["batch"] == batch), {})
    return {
        "path": str(path),
        "date": (report.get("environment") or {}).get("date"),
        "decode_ms_per_step": decode.get("ms_per_step"),
        "offline_output_tokens_per_s": (engine.get("offline") or {}).get("output_tokens_per_s"),
        "offline_workload": {k: (engine.get("offline") or {}).get(k) for k in ("requests", "input_len", "output_len")},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def decode_median(report: dict[str, Any], mix: str) -> float | None:
    runs = report["decode"].get(mix) or []
    return median([r["ms_per_step"] for r in runs]) if runs else None


def offline_rate(report: dict[str, Any], mix: str) -> float | None:
    return (report["offline"].get(mix) or {}).get("output_tokens_per_s")


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """Each a slowdown: above 1 means the second run is slower than the first."""
    recorded = report.get("recorded") or {}
    return {
        "featured_over_plain_decode": _ratio(decode_median(report, "featured"), decode_median(report, "plain")),
        "plain_over_greedy_decode": _ratio(decode_median(report, "plain"), decode_median(report, "greedy")),
        "plain_over_structured_offline": _ratio(offline_rate(report, "plain"), offline_rate(report, "structured")),
        "greedy_now_over_recorded_decode": _ratio(decode_median(report, "greedy"), recorded.get("decode_ms_per_step")),
        "recorded_over_plain_now_offline": _ratio(
            recorded.get("offline_output_tokens_per_s"), offline_rate(report, "plain")
        ),
    }


def targets(report: dict[str, Any], judged: bool) -> list[dict[str, Any]]:
    """The acceptance targets; `judged` False (a CPU or smoke run) leaves them unjudged."""
    r = report["ratios"]
    rows = [
        _target("featured / plain decode ms/step", r["featured_over_plain_decode"], MAX_FEATURE_COST, "<="),
        _target("plain / structured offline tokens/s", r["plain_over_structured_offline"], MAX_FEATURE_COST, "<="),
        _target("greedy decode now / recorded", r["greedy_now_over_recorded_decode"], MAX_DRIFT, "<="),
        _target("offline recorded / plain now", r["recorded_over_plain_now_offline"], MAX_DRIFT, "<="),
    ]
    if not judged:
        rows = [{**t, "verdict": "not judged (cpu or smoke)"} for t in rows]
    return rows


def to_markdown(report: dict[str, Any]) -> str:
    env, model, w = report["environment"], report["model"], report["workload"]
    grammar = report.get("grammar") or {}
    recorded = report.get("recorded") or {}
    lines = [
        f"# Tidal sampling features: {report['preset']} ({model['dtype']})" + (" [smoke]" if report["smoke"] else ""),
        "",
        f"{env['date']} — {env['gpu'] or env['cpu']}; torch {env['torch']}, triton {env['triton']}, "
        f"CUDA {env['cuda']}, Python {env['python']}; random weights (seed {model['seed']}), vocabulary "
        f"{model['vocab_size']}.",
    ]
    if grammar:
        lines.append(
            f"Grammar vocabulary: {grammar['vocab_size']} tokens, {grammar['synthetic_tokens']} of them synthetic "
            f"(perf/grammar_vocab.py); schema compiled in {_f(grammar.get('compile_seconds'), '.3f')} s."
        )
    lines += [
        "",
        f"## Decode, batch {w['decode_batch']} ({w['decode_prompt_len']}-token prompts, {w['decode_new_tokens']} "
        f"tokens, first {w['decode_warmup_tokens']} untimed; median of {w['decode_repeats']})",
        "",
        "| mix | ms/step | runs | tokens/s |",
        "| --- | ---: | --- | ---: |",
    ]
    for mix, what in (
        ("greedy", "all greedy (gpu_perf's run)"),
        ("plain", "plain: greedy / sampled rows"),
        ("featured", "featured: half the rows + logprobs 5, penalties, logit_bias"),
    ):
        ms = decode_median(report, mix)
        runs = ", ".join(f"{r['ms_per_step']:.3f}" for r in report["decode"].get(mix) or [])
        rate = w["decode_batch"] * 1000.0 / ms if ms else None
        lines.append(f"| {what} | {_f(ms, '.3f')} | {runs} | {_f(rate, '.0f')} |")
    lines += [
        "",
        f"## Offline, {w['offline_requests']} x ({w['offline_input_len']} in, {w['offline_output_len']} out)",
        "",
        "| mix | output tokens/s | seconds | mean output tokens / request |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mix, what in (("plain", "plain (greedy)"), ("structured", "JSON schema (greedy)")):
        o = report["offline"].get(mix) or {}
        lines.append(
            f"| {what} | {_f(o.get('output_tokens_per_s'), '.0f')} | {_f(o.get('seconds'))} "
            f"| {_f(o.get('mean_output_tokens'), '.1f')} |"
        )
    lines += ["", "## Ratios (above 1: slower)", "", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {name} | {_f(value, '.3f')} |" for name, value in report["ratios"].items()]
    lines.append("")
    if recorded:
        lines.append(
            f"Recorded: {recorded['path']} ({recorded['date']}): decode {_f(recorded['decode_ms_per_step'], '.3f')} "
            f"ms/step, offline {_f(recorded['offline_output_tokens_per_s'], '.0f')} output tokens/s."
        )
    else:
        lines.append("Recorded: no gpu_perf report for this preset and device (no plain-now-vs-recorded ratio).")
    lines += ["", "## Targets", "", "| target | value | needed | verdict |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {t['name']} | {_f(t['value'], '.3f')} | {t['target']} | {t['verdict']} |" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(to_markdown(report))
