"""benchmarks/http_serving.py: its statistics (pure), and its smallest run end to end on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from http_serving import StreamTimes, percentile, ratios, summarize  # noqa: E402


def test_percentile_interpolates_between_sorted_values():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_times_first_events_and_the_gaps_between_events():
    requests = [StreamTimes(0.0, [0.100, 0.110, 0.130]), StreamTimes(0.05, [0.25, 0.26, 0.27])]
    got = summarize(requests, tokens_per_request=3)
    assert got["ttft_ms_p50"] == pytest.approx(150.0)  # 100 and 200 ms
    assert got["itl_ms_p50"] == pytest.approx(10.0)  # gaps 10, 20, 10, 10 ms
    assert got["events"] == 6 and got["seconds"] == pytest.approx(0.27)
    assert got["output_tokens_per_s"] == pytest.approx(6 / 0.27)
    engine = {**got, "ttft_ms_p50": 100.0, "output_tokens_per_s": 30.0}
    assert ratios(engine, got)["ttft_ms_p50"] == pytest.approx(1.5)
    assert ratios(engine, got)["throughput"] == pytest.approx(30.0 / (6 / 0.27))


@pytest.mark.slow
def test_smoke_run_on_cpu_serves_every_request_through_both_paths(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/http_serving.py", "--preset", "tiny", "--device", "cpu", "--streams", "3",
         "--smoke", "--out", tmp_path],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "http-serving-tiny-cpu-smoke.json").read_text())
    (run,) = report["runs"]
    assert run["switch_interval_us"] == 5000
    for side in ("engine", "http"):
        assert run[side]["requests"] == run[side]["requests_with_output"] == 6
        assert run[side]["ttft_ms_p50"] > 0 and run[side]["itl_ms_p50"] > 0
    assert "| inter-token p50 ms |" in result.stdout
