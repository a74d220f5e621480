"""The step-floor benchmark (benchmarks/kernels/step_floor.py) reads what the batch-1 step reads, launch for launch,
and its streaming kernel reads every word of a buffer exactly once: interpreted on a CPU, compiled on a GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

import step_floor


@pytest.mark.parametrize(
    ("preset", "weight_bytes", "launches", "gigabytes"),
    [
        # The bound printed by profile_steps.py for this step: "weights 3.37 GB" (FP8) and 6.08 GB read (bf16).
        ("qwen3-30b-a3b", 1.0, 48 * 6 + 1, 3.37),
        ("qwen3-30b-a3b", 2.0, 48 * 6 + 1, 6.09),
        ("llama3-8b", 2.0, 32 * 5 + 1, 15.02),
    ],
)
def test_the_launch_list_reads_the_steps_bytes(preset, weight_bytes, launches, gigabytes):
    listed = step_floor.batch1_launches(preset, weight_bytes, context=160)
    assert len(listed) == launches
    assert sum(launch.num_bytes for launch in listed) / 1e9 == pytest.approx(gigabytes, abs=0.01)
    # Qwen3's experts: 8 of width 768 over a hidden size of 2048, gate and up then down.
    if preset.startswith("qwen3"):
        by_name = {launch.name: launch.num_bytes for launch in listed[:6]}
        assert by_name["gate_up"] == int(8 * 2 * 768 * 2048 * weight_bytes)
        assert by_name["down"] == by_name["gate_up"] // 2


@pytest.mark.parametrize("words", [1, 1000, 5000, 70_001])
def test_the_streaming_kernel_reads_every_word_once(words):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    item = step_floor.prepare(step_floor.Launch("x", words * 4), device, programs_per_sm=2)
    item.buffer.copy_(torch.arange(1, words + 1, dtype=torch.int32, device=device) % 7)
    out = torch.full((item.programs,), -1, dtype=torch.int32, device=device)
    step_floor.run_chain([item], out, read=True, early=False, pdl=False)
    assert int(out.sum()) == int(item.buffer.sum())
    step_floor.run_chain([item], out, read=False, early=False, pdl=False)
    assert int(out.abs().sum()) == 0  # the empty launch reads nothing, and still stores
