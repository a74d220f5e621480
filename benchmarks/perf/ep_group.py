"""benchmarks/ep_group_perf.py's figures, apart from the I/O that gathers them: a rank's counters read from its
/metrics, the per-step figures of a window between two readings, the output checks, and the printed report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

NVLINK_H200_GBS = 450.0  # NVLink 4 on an H200 SXM: 18 links x 25 GB/s each way


# ----- a rank's counters, and a window between two readings -----


@dataclass(frozen=True)
class RankReading:
    """One rank's counters at one moment."""

    at: float  # monotonic
    generated_tokens: float
    group_steps: float  # tidal_expert_parallel_steps_total: forwards and empty steps
    exchange_seconds: dict[str, float]  # by phase; empty unless the rank times its exchanges
    exchange_bytes_sent: dict[str, float]  # by phase
    exchanges: dict[str, float]  # by phase


def parse_reading(at: float, metrics_text: str) -> RankReading:
    """A rank's /metrics text, read at monotonic time `at` -> its counters."""
    generated = steps = 0.0
    seconds: dict[str, float] = {}
    sent: dict[str, float] = {}
    exchanges: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            phase = sample.labels.get("phase", "")
            if sample.name == "tidal_generation_tokens_total":
                generated = sample.value
            elif sample.name == "tidal_expert_parallel_steps_total":
                steps = sample.value
            elif sample.name == "tidal_expert_exchange_seconds_total":
                seconds[phase] = sample.value
            elif sample.name == "tidal_expert_exchange_bytes_total" and sample.labels.get("direction") == "sent":
                sent[phase] = sample.value
            elif sample.name == "tidal_expert_exchanges_total":
                exchanges[phase] = sample.value
    return RankReading(at, generated, steps, seconds, sent, exchanges)


@dataclass(frozen=True)
class RankDecode:
    rank: int
    tokens_per_s: float
    steps: int
    ms_per_step: float
    moe_layers_per_step: float  # exchanges / steps: every MoE layer exchanges once a step
    dispatch_ms_per_step: float | None
    combine_ms_per_step: float | None
    dispatch_mb_per_step: float
    combine_mb_per_step: float


@dataclass(frozen=True)
class BatchDecode:
    batch_per_rank: int
    timed_exchanges: bool
    window_s: float
    group_tokens_per_s: float
    ranks: list[RankDecode]
    cut_short: bool  # a stream ended inside the window: the rates undercount


def _delta(after: dict[str, float], before: dict[str, float], phase: str) -> float:
    return after.get(phase, 0.0) - before.get(phase, 0.0)


def rank_decode(rank: int, before: RankReading, after: RankReading) -> RankDecode:
    elapsed = after.at - before.at
    steps = int(after.group_steps - before.group_steps)
    per_step = max(steps, 1)
    timed = bool(after.exchange_seconds)

    def ms(phase: str) -> float | None:
        return 1000 * _delta(after.exchange_seconds, before.exchange_seconds, phase) / per_step if timed else None

    return RankDecode(
        rank=rank,
        tokens_per_s=(after.generated_tokens - before.generated_tokens) / elapsed,
        steps=steps,
        ms_per_step=1000 * elapsed / per_step,
        moe_layers_per_step=_delta(after.exchanges, before.exchanges, "dispatch") / per_step,
        dispatch_ms_per_step=ms("dispatch"),
        combine_ms_per_step=ms("combine"),
        dispatch_mb_per_step=_delta(after.exchange_bytes_sent, before.exchange_bytes_sent, "dispatch") / per_step / 1e6,
        combine_mb_per_step=_delta(after.exchange_bytes_sent, before.exchange_bytes_sent, "combine") / per_step / 1e6,
    )


# ----- outputs and lifecycle -----


@dataclass(frozen=True)
class OutputCheck:
    rank: int
    prompt: int
    identical: bool
    first_difference: int | None  # character index where the texts part, None when identical


def compare(rank: int, prompt: int, text: str, reference: str) -> OutputCheck:
    if text == reference:
        return OutputCheck(rank, prompt, True, None)
    first = next((i for i, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b), None)
    return OutputCheck(rank, prompt, False, first if first is not None else min(len(text), len(reference)))


@dataclass(frozen=True)
class GroupTransition:
    step: str
    wall_s: float  # from the calls to the last answer
    rank_durations_s: list[float]  # each rank's own duration_s
    bytes_moved: int  # over all ranks


# ----- the report -----


def print_decode(batches: list[dict[str, Any]], link_gbs: float) -> None:
    for batch in batches:
        flag = "  (CUT SHORT: raise --max-tokens)" if batch["cut_short"] else ""
        timed = "exchanges timed" if batch["timed_exchanges"] else "untimed"
        print(f"batch {batch['batch_per_rank']} per rank, {timed}: group {batch['group_tokens_per_s']:.1f} tok/s{flag}")
        for r in batch["ranks"]:
            sent_kb = 1000 * (r["dispatch_mb_per_step"] + r["combine_mb_per_step"])
            line = f"  rank {r['rank']}: {r['tokens_per_s']:9.1f} tok/s {r['ms_per_step']:8.2f} ms/step"
            line += f" ({r['moe_layers_per_step']:.0f} MoE layers); sent {sent_kb:8.1f} KB/step"
            if r["dispatch_ms_per_step"] is not None:
                link_us = sent_kb / link_gbs  # KB / (GB/s) = us
                layers = max(r["moe_layers_per_step"], 1.0)
                per_layer = 1000 * r["dispatch_ms_per_step"] / layers, 1000 * r["combine_ms_per_step"] / layers
                line += f"; dispatch {r['dispatch_ms_per_step']:.3f} + combine {r['combine_ms_per_step']:.3f} ms/step"
                line += f", a layer {per_layer[0]:.0f} + {per_layer[1]:.0f} us (DeepEP's unit)"
                line += f"; the bytes alone at {link_gbs:g} GB/s: {link_us:.1f} us"
            print(line)


def summarize(results: dict[str, Any], link_gbs: float) -> int:
    failures = 0
    for key in ("outputs", "outputs_after_lifecycle"):
        checks = results.get(key)
        if checks:
            same = sum(c["identical"] for c in checks)
            parts = [
                f"rank {c['rank']} prompt {c['prompt']} at char {c['first_difference']}"
                for c in checks
                if not c["identical"]
            ]
            print(
                f"{key}: {same} of {len(checks)} identical to the world-size-1 worker"
                + (f"; differ: {parts}" if parts else "")
            )
            failures += len(checks) - same
    print_decode(results["decode"], link_gbs)
    if "decode_timed" in results:
        print_decode(results["decode_timed"], link_gbs)
    failures += sum(b["cut_short"] for b in results["decode"] + results.get("decode_timed", []))
    if "gpu_memory_mib" in results:
        print(f"GPU memory in use on each rank's GPU after the decode runs (MiB): {results['gpu_memory_mib']}")
    for t in results.get("lifecycle", []):
        durations = ", ".join(f"{d:.2f}" for d in t["rank_durations_s"])
        print(
            f"{t['step']:<42} {t['wall_s']:7.2f} s for the group (ranks: {durations}); {t['bytes_moved'] / 1e9:.2f} GB"
        )
    return 1 if failures else 0
