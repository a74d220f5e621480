"""CUDA graphs for decode-only steps: one captured forward per batch size, replayed with fresh inputs (steps with
prompt tokens have their own, prefill_graphs.py; both share `capture_graphs` and one memory pool).

Decode steps are many small kernels, so launching them one by one from Python costs more than running them.
A graph per padded batch size records the whole forward once; a step copies its plan into the graph's static
input tensors and replays it. Padding rows write nothing (slot -1) and attend to nothing (seq_len 0). The graphs
hold the weights' and the KV cache's addresses: those must stay where they are while the graphs live (the runner
recaptures them after a restore that moved a region).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tidal.worker.engine.step_inputs import copy_token_inputs, step_inputs
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.memory.kv_region import KVCaches
from tidal.worker.models.base import CausalLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as GraphPool  # what torch.cuda.graph_pool_handle() returns

log = logging.getLogger(__name__)


def capture_graphs(
    sizes: list[int],
    forward: Callable[[int], torch.Tensor],
    pool: GraphPool,
    prepare: Callable[[int], None] | None = None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph of `forward(size)` per size, all in the memory pool `pool` (shared with other graph sets of the
    same runner: graphs replay one at a time on one stream). -> (size -> graph, size -> the output it writes).
    `prepare(size)` sets the static inputs that the capture's own runs read, outside the graph."""
    order = sorted(sizes, reverse=True)
    # Every warm-up (Triton compiles, allocator settles) before the first capture: a warm-up between two captures
    # would run in torch's ordinary cache, which a capture empties, beside the pool's copy of the same activations,
    # twice the memory at the peak.
    for size in order:
        if prepare is not None:
            prepare(size)
        forward(size)
    torch.cuda.synchronize()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    for size in order:  # largest first: smaller graphs reuse its pool memory
        if prepare is not None:
            prepare(size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


# What the graphs' pool holds beyond the largest captured step's activations. Measured on an H100 (2026-12-06,
# profile_steps.py with FP8 weights and cache, decode graphs to batch 256 and prompt graphs to 2048 tokens): the
# Llama-3-8B shape's pool 288 MiB against 206 MiB of activations, Qwen3-30B-A3B's 384 against 286. Every decode
# graph keeps its own output (17 and 9 MiB of those), and the rest, ~31% of the activations in both, is the
# allocator's: whole segments, and blocks split by one graph that the next cannot reuse. Held back: half the
# activations more, and 64 MiB for a tiny model's segments, which no activation count shows.
GRAPH_POOL_FRAGMENTATION = 0.5
GRAPH_POOL_SEGMENT_SLACK_BYTES = 64 * 2**20


def graph_pool_estimate(peak_activation_bytes: int, max_num_seqs: int, hidden_row_bytes: int) -> int:
    """The bytes to hold back for the graphs' pool, from the largest graphed step's profiled activations: those,
    the decode graphs' outputs ([size, H] each, kept while the graphs live), and the allocator's share above."""
    decode_outputs = sum(capture_sizes(max_num_seqs)) * hidden_row_bytes
    fragmentation = int(peak_activation_bytes * GRAPH_POOL_FRAGMENTATION)
    return peak_activation_bytes + decode_outputs + fragmentation + GRAPH_POOL_SEGMENT_SLACK_BYTES


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, kv_caches: KVCaches, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_blocks = max_blocks_per_seq
        self.sizes = capture_sizes(max_num_seqs)
        # batch size -> the smallest captured size that holds it
        self._size_for = [next(s for s in self.sizes if s >= b) for b in range(self.sizes[-1] + 1)]
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [N]
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)  # [N, max_blocks]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # [N + 1], one token each
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # batch size -> hidden [bs, H] written by its graph
        self.capture_seconds = 0.0  # the last capture's, warm-ups and kernel compiles included

    def can_run(self, plan: StepPlan) -> bool:
        return (
            plan.is_decode_only
            and plan.num_seqs <= self.sizes[-1]
            and max(map(len, plan.block_tables)) <= self.max_blocks
        )

    @torch.inference_mode()
    def capture(self, pool: GraphPool) -> None:
        start = time.monotonic()
        self._graphs, self._outputs = capture_graphs(self.sizes, self._forward, pool)
        self.capture_seconds = time.monotonic() - start
        log.info("captured CUDA graphs for decode batch sizes %s in %.1fs", self.sizes, self.capture_seconds)

    def run(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """-> hidden [B, H] of a decode-only plan (a view into the graph's output: use it before the next run).
        `previous_tokens` [S'] on the device: the previous step's sampled tokens, for the plan's unknown inputs."""
        n = plan.num_seqs
        size = self._size_for[n]
        width = max(map(len, plan.block_tables))
        inputs = step_inputs(plan, width, self.input_ids.device)
        copy_token_inputs(inputs, self.input_ids, self.positions, self.slot_mapping, previous_tokens)
        self.seq_lens[:n].copy_(inputs.seq_lens)  # int64 -> int32
        self.block_tables[:n, :width].copy_(inputs.block_tables)
        if size > n:  # padding rows: write nothing, attend to nothing
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self._graphs[size].replay()
        return self._outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        batch = AttentionBatch(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            is_decode_only=True,
            kv_caches=self.kv_caches,
        )
        hidden: torch.Tensor = self.model(self.input_ids[:size], self.positions[:size], batch)
        return hidden
