"""benchmarks/ep_group_perf.py: its per-rank figures (pure), the GPU memory reading, and its smallest run end to end
on the CPU (two worker processes over gloo)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf.ep_group import RankReading, compare, parse_reading, rank_decode  # noqa: E402

from tidal.worker.testing.gpu_memory import MIB, parse_memory_used  # noqa: E402
from tidal.worker.testing.tiny_models import TINY_ARCHS  # noqa: E402


def reading(at: float, tokens: float, steps: int, seconds: dict[str, float], sent: float) -> RankReading:
    return RankReading(at, tokens, steps, seconds, {"dispatch": sent, "combine": sent / 2}, {"dispatch": 48.0 * steps})


def test_a_rank_window_gives_rates_per_step_and_exchange_time_only_when_timed():
    before = reading(10.0, 1000, 100, {"dispatch": 1.0, "combine": 2.0}, 1e6)
    after = reading(12.0, 1800, 300, {"dispatch": 1.4, "combine": 2.6}, 5e6)
    got = rank_decode(3, before, after)
    assert got.tokens_per_s == pytest.approx(400.0)
    assert got.steps == 200 and got.ms_per_step == pytest.approx(10.0)
    assert got.moe_layers_per_step == pytest.approx(48.0)
    assert got.dispatch_ms_per_step == pytest.approx(2.0) and got.combine_ms_per_step == pytest.approx(3.0)
    assert got.dispatch_mb_per_step == pytest.approx(0.02) and got.combine_mb_per_step == pytest.approx(0.01)
    untimed = rank_decode(3, reading(10.0, 0, 0, {}, 0), reading(11.0, 10, 5, {}, 0))
    assert untimed.dispatch_ms_per_step is None and untimed.combine_ms_per_step is None


def test_a_reading_takes_the_counters_from_the_metrics_text():
    text = (
        "tidal_generation_tokens_total 120.0\n"
        "tidal_expert_parallel_steps_total 40.0\n"
        'tidal_expert_exchanges_total{phase="dispatch"} 160.0\n'
        'tidal_expert_exchange_bytes_total{direction="sent",phase="combine"} 2048.0\n'
        'tidal_expert_exchange_bytes_total{direction="received",phase="combine"} 9999.0\n'
        'tidal_expert_exchange_seconds_total{phase="dispatch"} 0.5\n'
    )
    got = parse_reading(7.0, text)
    assert (got.at, got.generated_tokens, got.group_steps) == (7.0, 120.0, 40.0)
    assert got.exchanges == {"dispatch": 160.0} and got.exchange_bytes_sent == {"combine": 2048.0}
    assert got.exchange_seconds == {"dispatch": 0.5}
    assert parse_reading(0.0, "tidal_generation_tokens_total 1.0\n").exchange_seconds == {}  # untimed


def test_compare_names_where_two_texts_part():
    assert compare(1, 0, "tide", "tide").identical
    assert compare(1, 0, "tidal", "tide").first_difference == 3
    assert compare(1, 0, "tid", "tide").first_difference == 3  # one is a prefix of the other


def test_gpu_memory_lines_parse_and_unfilled_ones_are_left_out():
    listing = "0, 81234\n1, [N/A]\n\n2, 17\n"
    assert parse_memory_used(listing) == {"0": 81234 * MIB, "2": 17 * MIB}


def test_smoke_run_on_cpu_measures_every_step_and_serves_the_reference(tmp_path):
    out = tmp_path / "ep.json"
    command = [sys.executable, str(REPO / "benchmarks" / "ep_group_perf.py"), "--arch", "qwen3_moe"]
    command += ["--world-size", "2", "--batches", "2", "--max-tokens", "400", "--window-s", "0.5"]
    command += ["--check-prompts", "2", "--check-tokens", "8", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [c["identical"] for c in record["outputs"]] == [True] * 4  # 2 prompts x 2 ranks
    assert all(c["identical"] for c in record["outputs_after_lifecycle"])
    extra = TINY_ARCHS["qwen3_moe"].extra
    moe_layers = extra["num_hidden_layers"] - len(extra["mlp_only_layers"])  # 3: every rank exchanges once a layer
    for key, timed in (("decode", False), ("decode_timed", True)):
        (batch,) = record[key]
        assert batch["timed_exchanges"] == timed and not batch["cut_short"]
        assert batch["group_tokens_per_s"] > 0
        for rank in batch["ranks"]:
            assert rank["steps"] > 0 and rank["moe_layers_per_step"] == pytest.approx(moe_layers)
            assert (rank["dispatch_ms_per_step"] is not None) == timed
        assert sum(r["dispatch_mb_per_step"] + r["combine_mb_per_step"] for r in batch["ranks"]) > 0
    steps = [t["step"] for t in record["lifecycle"]]
    assert len(steps) == 5 and all(len(t["rank_durations_s"]) == 2 for t in record["lifecycle"])
    assert "gpu_memory_mib" not in record  # no GPU here
