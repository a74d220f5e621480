"""benchmarks/perf/step_bound.py (pure) and step_counts.py (counted on the meta device): a step's hardware bound."""

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf.device import H200_BF16_DENSE_TFLOPS, H200_FP8_DENSE_TFLOPS, ISSUE_COPY_TBS  # noqa: E402
from perf.presets import PRESETS, write_model_dir  # noqa: E402
from perf.step_bound import (  # noqa: E402
    ModelShape,
    attention_pairs,
    bound_line,
    decode_bound,
    kv_bytes_per_token,
    step_bound,
)

# Llama-3-8B by hand: per layer q and o 4096x4096, k and v 1024x4096, gate and up 14336x4096, down 4096x14336, two
# norms of 4096; a final norm; the LM head and the embedding table 128256x4096 each.
LAYER_MATMUL = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
LM_HEAD = 128256 * 4096
MATMUL_8B = 32 * LAYER_MATMUL + LM_HEAD
NORMS_8B = 32 * 2 * 4096 + 4096
LLAMA3_8B = ModelShape(
    dense_bytes=(MATMUL_8B + NORMS_8B) * 2,
    dense_matmul_params=MATMUL_8B,
    lm_head_params=LM_HEAD,
    layers=32,
    heads=32,
    head_dim=128,
    kv_bytes_per_token=kv_bytes_per_token(32, 8, 128, 2),
)


def _meta_model(preset: str, tmp_path):
    import torch

    from tidal.worker.loader.hf_config import load_hf_config
    from tidal.worker.models.registry import resolve_model_class

    config = load_hf_config(write_model_dir(PRESETS[preset], tmp_path))
    with torch.device("meta"):
        model = resolve_model_class(config.architectures).from_hf_config(config, torch.bfloat16, torch.device("meta"))
    return model, config


def test_the_8b_decode_bound_at_batch_256_is_its_memory():
    b = decode_bound(LLAMA3_8B, 256, 384, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    assert round(b.weight_bytes / 1e9, 2) == 15.01  # 16.06 GB less the 1.05 GB table a step only gathers from
    assert b.kv_bytes == 256 * 384 * 32 * 8 * 128 * 2 * 2 + 256 * 32 * 8 * 128 * 2 * 2  # cache read + new K/V
    assert b.flops == 2 * MATMUL_8B * 256 + 4 * 256 * 384 * 32 * 128 * 32
    assert b.memory_us == pytest.approx(b.total_bytes / 4.3e6)
    assert b.compute_us == pytest.approx(b.flops / 989e6)
    assert b.binds == "memory" and b.bound_us == pytest.approx(6495, abs=1)
    assert b.compute_us == pytest.approx(3937, abs=1)


def test_a_large_enough_batch_binds_on_compute():
    b = decode_bound(LLAMA3_8B, 2048, 32, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    assert b.binds == "compute" and b.bound_us == b.compute_us > b.memory_us


def test_projections_held_in_fp8_count_at_the_fp8_peak():
    """The body's projections in FP8 (the LM head never): their FLOPs at twice the rate, the rest at bf16's."""
    fp8 = dataclasses.replace(LLAMA3_8B, fp8_matmul_params=MATMUL_8B - LM_HEAD)
    with pytest.raises(ValueError, match="fp8_peak_tflops"):
        decode_bound(fp8, 2048, 32, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    b = decode_bound(fp8, 2048, 32, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS, H200_FP8_DENSE_TFLOPS)
    bf16 = decode_bound(LLAMA3_8B, 2048, 32, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    assert b.flops == bf16.flops and b.fp8_flops == 2 * (MATMUL_8B - LM_HEAD) * 2048
    assert b.compute_us == pytest.approx(((b.flops - b.fp8_flops) / 989 + b.fp8_flops / 1979) / 1e6)
    assert b.compute_us < 0.6 * bf16.compute_us
    assert f"({b.fp8_flops / 1e12:.2f} in FP8 at 1979); " in bound_line(b, None)
    assert "in FP8" not in bound_line(bf16, None)


def test_attention_pairs_are_causal():
    assert attention_pairs([1, 1], [10, 20]) == 30  # decode: every cached token
    assert attention_pairs([4], [4]) == 1 + 2 + 3 + 4  # a whole prompt
    assert attention_pairs([2], [6]) == 5 + 6  # a chunk after 4 cached tokens


def test_a_prefill_step_runs_the_lm_head_only_on_the_rows_that_sample():
    b = step_bound(LLAMA3_8B, [100], [100], 1, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    body = MATMUL_8B - LM_HEAD
    assert b.flops == 2 * (body * 100 + LM_HEAD) + 4 * (100 * 101 // 2) * 32 * 128 * 32
    assert b.kv_bytes == 200 * LLAMA3_8B.kv_bytes_per_token  # the chunk's own K/V written, then read by attention


def test_moe_reads_the_experts_touched_and_multiplies_through_top_k():
    shape = ModelShape(
        dense_bytes=1000,
        dense_matmul_params=400,
        lm_head_params=100,
        layers=2,
        heads=1,
        head_dim=1,
        kv_bytes_per_token=0,
        expert_bytes=50,
        expert_params=25,
        top_k=2,
    )
    b = decode_bound(shape, 4, 1, 7, 1e-6, 1e-6)  # 1 byte/us, 1 FLOP/us
    assert b.weight_bytes == 1000 + 7 * 50
    assert b.flops == 2 * ((300 + 2 * 2 * 25) * 4 + 100 * 4) + 4 * 4 * 2
    assert b.memory_us == pytest.approx(1350) and b.compute_us == pytest.approx(b.flops)


def test_bound_line_states_both_terms_the_figures_and_the_ratio():
    b = decode_bound(LLAMA3_8B, 256, 384, 0, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    line = bound_line(b, 10300.0)
    assert line.startswith("bound: weights 15.01 GB + KV 12.92 GB = 27.93 GB -> 6495 us at 4.3 TB/s; ")
    assert "3.89 TFLOP -> 3937 us at 989 TFLOP/s; bound max = 6495 us (memory); wall / bound = 1.59 x" in line
    assert "wall" not in bound_line(b, None)


def test_model_shape_counts_the_8b_preset_as_by_hand(tmp_path):
    import torch
    from perf.step_counts import model_shape

    model, config = _meta_model("llama3-8b", tmp_path)
    assert model_shape(model, config, torch.bfloat16) == LLAMA3_8B


def test_model_shape_of_a_moe_preset_agrees_with_the_moe_step_bytes(tmp_path):
    import torch
    from perf.moe import step_bytes
    from perf.step_counts import model_shape

    model, config = _meta_model("qwen3-30b-a3b", tmp_path)
    shape = model_shape(model, config, torch.bfloat16)
    step = step_bytes(model)
    assert step is not None
    assert (shape.dense_bytes, shape.expert_bytes, shape.top_k) == (step.dense_bytes, step.expert_bytes, 8)
    assert shape.expert_params * 2 == shape.expert_bytes == 3 * 768 * 2048 * 2
    b1 = decode_bound(shape, 1, 1, step.layers * step.top_k, ISSUE_COPY_TBS, H200_BF16_DENSE_TFLOPS)
    assert b1.weight_bytes == step.batch1_bytes  # batch 1 touches top-k experts per layer
    active = shape.dense_matmul_params + shape.layers * shape.top_k * shape.expert_params
    # Norms aside, every weight a batch-1 step reads is multiplied through: 6.08 GB in bf16. The published 3.3e9
    # active parameters count the embedding table as well (another 0.31e9).
    assert round(active / 1e9, 2) == 3.04 and round(step.batch1_bytes / 1e9, 2) == 6.08


def test_model_shape_counts_what_the_fp8_weights_hold(tmp_path):
    """With weight_dtype fp8: every attention and MLP projection of the 8B (not the LM head), and the experts'
    stacks of the MoE."""
    import torch
    from perf.step_counts import model_shape

    from tidal.worker.layers.fp8_weights import hold_fp8_weights

    model, config = _meta_model("llama3-8b", tmp_path / "dense")
    hold_fp8_weights(model)
    shape = model_shape(model, config, torch.bfloat16)
    assert shape.fp8_matmul_params == 32 * LAYER_MATMUL and not shape.fp8_experts
    moe, moe_config = _meta_model("qwen3-30b-a3b", tmp_path / "moe")
    hold_fp8_weights(moe)
    assert model_shape(moe, moe_config, torch.bfloat16).fp8_experts
