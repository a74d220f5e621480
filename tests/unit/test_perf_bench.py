"""benchmarks/gpu_perf.py: its derived figures (pure), and its smallest run end to end on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf.presets import PRESETS, SMOKE_WORKLOAD, Workload, write_model_dir  # noqa: E402
from perf.random_model import build_random_model, write_random_checkpoint  # noqa: E402
from perf.report import (  # noqa: E402
    agreement,
    bandwidth_bound,
    common_prefix,
    comparison,
    moe_ab_markdown,
    prefill_graphs_stem,
    result_stem,
    targets,
    to_markdown,
)
from perf.timing import steady_ms_per_step  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def test_common_prefix_and_agreement():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([5], [6]) == 0
    got = agreement({1: [[1, 2, 3]], 2: [[1, 2, 3], [4, 5, 6]]}, {1: [[1, 2, 3]], 2: [[1, 9, 9], [7, 5, 6]], 8: []})
    assert got["rows"] == 3 and got["rows_identical"] == 1 and not got["all_identical"]
    by_batch = {b["batch"]: b for b in got["per_batch"]}
    assert set(by_batch) == {1, 2}  # only batch sizes both sides ran
    assert by_batch[2]["rows_first_token_equal"] == 1
    assert by_batch[2]["min_common_prefix"] == 0 and by_batch[2]["mean_common_prefix"] == 0.5


def test_bandwidth_bound_matches_the_issue():
    # 16.06 GB of weights at 4.3 TB/s: 3.73 ms per step, ~268 tokens/s.
    bw = bandwidth_bound(16_060_000_000, 4.4, 4.3, 4.27)
    assert bw["bound_ms_per_step"] == pytest.approx(3.735, abs=1e-3)
    assert bw["bound_tokens_per_s"] == pytest.approx(267.7, abs=0.1)
    assert bw["batch1_fraction_of_bound"] == pytest.approx(3.735 / 4.4, abs=1e-3)
    assert bw["batch1_fraction_of_measured_copy"] == pytest.approx(16.06 / 4.27 / 4.4, abs=1e-3)
    assert bandwidth_bound(10, None, 4.3, None)["batch1_fraction_of_bound"] is None


def _figures(decode: dict[int, float], offline: float) -> dict:
    return {
        "decode": [{"batch": b, "tokens_per_s": t} for b, t in decode.items()],
        "ttft_ms": {"median": 10.0},
        "offline": {"output_tokens_per_s": offline},
    }


def test_comparison_and_targets_only_for_the_8b_shape_on_cuda():
    engine, hf = _figures({1: 230.0, 32: 5000.0, 64: 9000.0}, 13000.0), _figures({1: 14.0, 32: 506.0}, 1000.0)
    hf["ttft_ms"]["median"] = 50.0
    cmp_ = comparison(engine, hf)
    assert [d["batch"] for d in cmp_["decode"]] == [1, 32]
    assert cmp_["ttft_speedup"] == 5.0 and cmp_["offline_speedup"] == 13.0
    assert comparison(engine, {"error": "boom"}) == {"decode": []}
    # A baseline that failed in its offline run still compares on the decode batches it measured.
    failed_late = {**hf, "offline": None, "error": "OutOfMemoryError"}
    assert [d["batch"] for d in comparison(engine, failed_late)["decode"]] == [1, 32]
    assert "offline_speedup" not in comparison(engine, failed_late)
    report = {"engine": engine, "comparison": cmp_, "bandwidth": bandwidth_bound(16_060_000_000, 4.35, 4.3, None)}
    assert targets("tiny", "cpu", report) == [] and targets("llama3-8b", "cpu", report) == []
    verdicts = {t["name"]: t["verdict"] for t in targets("llama3-8b", "cuda", report)}
    assert verdicts == {
        "batch-1 decode, fraction of the bandwidth bound": "PASS",  # 3.735 / 4.35 = 85.9%
        "offline output tokens/s": "MISS",  # 13,000 < 20,000
        "decode speedup over transformers at batch 1": "PASS",  # 16.4x
        "decode speedup over transformers at batch 32": "MISS",  # 9.9x
    }


def test_batch1_target_threshold():
    def verdict(ms: float) -> str:
        report = {"engine": {}, "comparison": {}, "bandwidth": bandwidth_bound(16_060_000_000, ms, 4.3, None)}
        return targets("llama3-8b", "cuda", report)[0]["verdict"]

    assert verdict(4.39) == "PASS"  # 85.1% of the bound
    assert verdict(4.41) == "MISS"  # 84.7%


def test_offline_target_is_the_raised_one():
    def verdict(tokens_per_s: float) -> str:
        report = {"engine": {"offline": {"output_tokens_per_s": tokens_per_s}}, "comparison": {},
                  "bandwidth": bandwidth_bound(16_060_000_000, 4.0, 4.3, None)}  # fmt: skip
        return targets("llama3-8b", "cuda", report)[1]["verdict"]

    assert verdict(19_889.6) == "MISS"  # FP8 weights on the H200, 2026-12-05
    assert verdict(20_000.0) == "PASS"


def test_steady_ms_per_step_skips_warmup():
    marks = [0.0, 0.5, 0.6, 0.7, 0.8]  # token k + 1 done at marks[k]; the first decode step (to token 2) is slow
    assert steady_ms_per_step(marks, 2) == pytest.approx(100.0)  # tokens 3..5: three steps in 0.3 s
    with pytest.raises(ValueError):
        steady_ms_per_step(marks[:1], 1)


def test_workload_refuses_nothing_to_time():
    with pytest.raises(ValueError, match="nothing would be timed"):
        Workload.model_validate({**SMOKE_WORKLOAD.model_dump(), "decode_warmup_tokens": 6})
    assert Workload.model_validate(SMOKE_WORKLOAD.model_dump()).max_num_seqs == 6


def test_a_record_names_prompt_graphs_only_off_the_engines_default():
    assert prefill_graphs_stem(2048, default=2048) == ""
    assert prefill_graphs_stem(0, default=2048) == "-eager-prompts"
    assert prefill_graphs_stem(512, default=2048) == "-prefill-graphs-512"


def test_result_stem():
    assert result_stem("llama3-8b", {"gpu": "NVIDIA H200"}, smoke=False) == "perf-llama3-8b-nvidia-h200"
    assert result_stem("tiny", {"gpu": None}, smoke=True) == "perf-tiny-cpu-smoke"


def test_llama3_8b_preset_has_the_issues_shape(tmp_path):
    import torch

    from tidal.worker.loader.hf_config import load_hf_config
    from tidal.worker.models.registry import resolve_model_class

    config = load_hf_config(write_model_dir(PRESETS["llama3-8b"], tmp_path))
    with torch.device("meta"):
        model = resolve_model_class(config.architectures).from_hf_config(config, torch.bfloat16, torch.device("meta"))
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert round(num_bytes / 1e9, 2) == 16.06  # the issue's bound: 16.06 GB read per batch-1 step
    assert (config.vocab_size, config.num_key_value_heads, config.max_position_embeddings) == (128256, 8, 8192)


def _meta_model(preset: str, tmp_path):
    import torch

    from tidal.worker.loader.hf_config import load_hf_config
    from tidal.worker.models.registry import resolve_model_class

    config = load_hf_config(write_model_dir(PRESETS[preset], tmp_path))
    with torch.device("meta"):
        return resolve_model_class(config.architectures).from_hf_config(config, torch.bfloat16, torch.device("meta"))


@pytest.mark.parametrize(
    ("preset", "billions", "weights_gb", "batch1_gb"),
    # Published sizes: Qwen3-30B-A3B 30.5e9 parameters (3.3e9 active), Mixtral-8x7B 46.7e9 (12.9e9 active). A step
    # reads the active weights less the embedding table: 6.08 GB (the issue's "about 6.6" counts the table too).
    [("qwen3-30b-a3b", 30.5, 61.1, 6.08), ("mixtral-8x7b", 46.7, 93.4, 25.5)],
)
def test_moe_presets_have_the_published_shapes_and_step_bytes(tmp_path, preset, billions, weights_gb, batch1_gb):
    from perf.moe import step_bytes

    model = _meta_model(preset, tmp_path)
    params = sum(p.numel() for p in model.parameters())
    assert round(params / 1e9, 1) == billions
    assert round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 1) == weights_gb
    step = step_bytes(model)
    assert step is not None and round(step.batch1_bytes / 1e9, 2) == batch1_gb


def test_moe_bounds_count_the_touched_experts_and_the_kv_cache():
    from perf.moe import StepBytes, batch_bound, with_times

    step = StepBytes(dense_bytes=1000, expert_bytes=100, experts_per_layer=8, top_k=2, layers=2)
    assert step.batch1_bytes == 1000 + 2 * 2 * 100
    bound = batch_bound(step, touched=[3, 5], kv_bytes_per_token=2, batch=4, context_len=10)
    assert bound["bound_bytes"] == 1000 + 8 * 100 + 4 * 10 * 2
    assert bound["touched_experts_per_layer_mean"] == 4.0 and bound["touched_experts_total"] == 8
    timed = with_times(bound, copy_tbs=1e-9, ms_per_step=3.76, forward_ms=None)  # 1880 bytes at 1000 B/s: 1880 ms
    assert timed["bound_ms"] == pytest.approx(1880.0) and timed["step_over_bound"] == pytest.approx(0.002)
    assert timed["forward_over_bound"] is None


def test_moe_targets_read_the_touched_bound_as_at_most():
    report = {
        "bandwidth": {"batch1_fraction_of_bound": 0.85},
        "moe": {"per_batch": [{"batch": 64, "step_over_bound": 1.3}]},
        "engine": {"offline": {"output_tokens_per_s": 40000.0}},
        "comparison": {"decode": [{"batch": 1, "speedup": 25.0}]},
    }
    verdicts = [(t["target"], t["verdict"]) for t in targets("qwen3-30b-a3b", "cuda", report)]
    assert verdicts == [(">= 0.8", "PASS"), ("<= 1.25", "MISS"), (">= 38097.5", "PASS"), (">= 20", "PASS")]
    assert len(targets("mixtral-8x7b", "cuda", report)) == 3  # no offline target: the issue sets it for Qwen3 only
    assert targets("qwen3-30b-a3b", "cpu", report) == []


def test_moe_ab_table_sets_the_grouped_path_beside_the_default_paths():
    engine = {"decode": [{"batch": 1, "ms_per_step": 2.0}, {"batch": 8, "ms_per_step": 4.0}]}
    ab = {"grouped_decode": [{"batch": 1, "ms_per_step": 3.0}, {"batch": 8, "ms_per_step": 4.0}]}
    lines = moe_ab_markdown(engine, ab)
    assert "| 1 | 2.000 | 3.000 | 1.500x |" in lines and "| 8 | 4.000 | 4.000 | 1.000x |" in lines
    assert moe_ab_markdown(engine, {}) == []  # no --moe-ab: no section


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_smoke_run_on_cpu_writes_a_consistent_report(tmp_path, preset):
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_perf.py", "--preset", preset, "--device", "cpu", "--smoke", "--out", tmp_path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / f"perf-{preset}-cpu-smoke.json").read_text())
    w = report["workload"]
    assert report["environment"]["torch"] and report["environment"]["date"]
    for side in ("engine", "transformers"):
        figures = report[side]
        assert not figures.get("error")
        assert [d["batch"] for d in figures["decode"]] == w["decode_batches"]
        assert all(d["ms_per_step"] > 0 and d["timed_steps"] == w["decode_new_tokens"] - 2 for d in figures["decode"])
        assert figures["ttft_ms"]["median"] > 0 and len(figures["ttft_ms"]["runs"]) == w["ttft_repeats"]
        assert figures["ttft_ms"]["kernels_busy_ms"] is None  # the profiler's device time: CUDA only
        assert figures["offline"]["output_tokens"] == w["offline_requests"] * w["offline_output_len"]
    assert report["engine"]["decode"][0]["forward_ms"] > 0
    # fp32 on the CPU: the engine's greedy output equals transformers' on every row.
    assert report["agreement"]["all_identical"] and report["agreement"]["rows"] == sum(w["decode_batches"])
    assert [d["batch"] for d in report["comparison"]["decode"]] == w["decode_batches"]
    if preset == "tiny":
        assert report["bandwidth"]["weight_bytes"] == report["model"]["weight_bytes"] > 0
    else:  # a MoE step's bound reads top-k experts per layer; every decode batch has its experts counted
        moe = report["moe"]
        assert 0 < report["bandwidth"]["weight_bytes"] == moe["batch1_bytes"] < report["model"]["weight_bytes"]
        assert [b["batch"] for b in moe["per_batch"]] == w["decode_batches"]
        assert moe["per_batch"][0]["touched_experts_total"] == moe["layers"] * moe["top_k"]  # batch 1: top-k each
        assert all(b["step_over_bound"] > 0 for b in moe["per_batch"])
    assert report["targets"] == []
    markdown = (tmp_path / f"perf-{preset}-cpu-smoke.md").read_text()
    assert "## Decode (steady state)" in markdown and "| 1 |" in markdown
    assert "kernels busy" not in markdown
    assert "prompt-step CUDA graphs none, setup" in markdown  # no graphs on a CPU, no pool to report
    report["engine"]["ttft_ms"]["kernels_busy_ms"] = 28.3  # as a GPU run records it
    report["engine"]["setup"].update(
        cuda_graph_prefill_tokens=[16, 32, 64, 128, 256, 384],
        cuda_graph_pool_gib=1.5,
        cuda_graph_pool_estimate_gib=1.75,
        prompt_graph_capture_seconds=4.12,
        decode_graph_capture_seconds=11.06,
    )
    gpu_markdown = to_markdown(report)
    assert "s (capturing graphs: prompt 4.1 s, decode 11.1 s)." in gpu_markdown
    assert "| TTFT, the prompt's kernels busy (ms) | 28.30 | — | |" in gpu_markdown
    pool = "graphs' pool 1.50 GiB (1.75 GiB held back for it), setup"
    assert f"prompt-step CUDA graphs 16 to 384 tokens (6 buckets), {pool}" in gpu_markdown


def test_a_written_random_checkpoint_holds_what_the_in_memory_model_draws(tmp_path):
    model_dir = write_model_dir(PRESETS["tiny-moe"], tmp_path / "tiny-moe")
    written = write_random_checkpoint(model_dir, torch.float32, torch.device("cpu"), seed=3)
    on_disk = {}
    for shard in model_dir.glob("model-*.safetensors"):
        on_disk.update(load_file(shard))
    drawn = build_random_model(model_dir, torch.float32, torch.device("cpu"), seed=3).model.checkpoint_weights()
    assert set(on_disk) == set(drawn) and written == sum(t.numel() * 4 for t in on_disk.values())
    for name, tensor in drawn.items():
        assert torch.equal(on_disk[name], tensor), name
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(on_disk)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"  # as drawn: "auto" serves it


def test_the_profiled_prefill_plan_is_the_engines_first_step(tmp_path):
    """profile_steps.py --prefill times `prefill_plan` on the runner: its logits pick the token the engine's own
    prefill of that prompt samples first (positions, slots and the sampled row as the scheduler lays them out)."""
    from perf.engine_side import build_engine, engine_config, prefill_plan

    from tidal.worker.engine.sampling_params import SamplingParams

    model_dir = write_model_dir(PRESETS["tiny"], tmp_path / "tiny")
    loaded = build_random_model(model_dir, torch.float32, torch.device("cpu"), seed=5)
    engine, _ = build_engine(engine_config(model_dir, loaded, torch.device("cpu"), SMOKE_WORKLOAD, 0.9), loaded)
    prompt = [11 + (7 * i) % 200 for i in range(37)]  # spans three 16-token blocks
    plan = prefill_plan(prompt, engine.config.block_size)
    assert plan.slot_mapping == list(range(37)) and plan.sample_indices == [36] and plan.block_tables == [[0, 1, 2]]
    logits = engine.runner.execute(plan)
    assert logits is not None and logits.shape[0] == 1
    want = torch.log_softmax(logits[0].float(), dim=-1)
    engine.add_request("first", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.logprobs]
    (first,) = outputs[0].logprobs
    assert first.token_id == int(want.argmax())
    assert first.logprob == pytest.approx(float(want.max()), abs=1e-4)
    assert [t for t, _ in first.top] == want.topk(3).indices.tolist()
