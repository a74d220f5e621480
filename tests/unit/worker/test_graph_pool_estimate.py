"""What the KV cache's sizing holds back for the CUDA graphs' pool (cuda_graphs.graph_pool_estimate), against the
pools measured on an H100 on 2026-12-06 (profile_steps.py, FP8 weights and cache, decode graphs to batch 256,
prompt graphs to 2048 tokens; the engine's log gave the pool and the profiled activations)."""

import pytest

from tidal.worker.engine.cuda_graphs import GRAPH_POOL_SEGMENT_SLACK_BYTES, capture_sizes, graph_pool_estimate

MIB = 2**20

# (shape, profiled activations of the largest graphed step, hidden width, the pool measured at capture)
MEASURED = [
    ("llama3-8b", 215_937_024, 4096, 288 * MIB),
    ("qwen3-30b-a3b", 299_526_656, 2048, 384 * MIB),
]


@pytest.mark.parametrize(("shape", "activations", "hidden", "measured_pool"), MEASURED, ids=[m[0] for m in MEASURED])
def test_the_estimate_covers_the_measured_pools(shape: str, activations: int, hidden: int, measured_pool: int):
    estimate = graph_pool_estimate(activations, max_num_seqs=256, hidden_row_bytes=hidden * 2)
    assert estimate >= measured_pool
    # The first estimate (activations and the segment slack alone) fell short of both pools: the reason for the rest.
    assert activations + GRAPH_POOL_SEGMENT_SLACK_BYTES < measured_pool


def test_every_decode_graph_keeps_its_own_output_rows():
    rows = sum(capture_sizes(256))
    assert rows == 1 + 2 + 4 + 8 + sum(range(16, 257, 16))
    with_outputs = graph_pool_estimate(0, 256, hidden_row_bytes=4096 * 2)
    assert with_outputs - graph_pool_estimate(0, 256, hidden_row_bytes=0) == rows * 4096 * 2


def test_a_tiny_model_still_holds_back_whole_segments():
    assert graph_pool_estimate(0, 1, hidden_row_bytes=0) == GRAPH_POOL_SEGMENT_SLACK_BYTES
