"""CUDA graphs for steps with prompt tokens (prefill chunks, alone or beside decodes), one per bucketed token count.

A prompt step's forward launches some ten kernels a layer from Python, and below a few thousand tokens the host
takes longer to launch them than the GPU to run them: a 1024-token Qwen3-30B-A3B prompt keeps an H100 busy 28 ms of
a 36-89 ms step (benchmarks/results/fp8-weights-h100.md). A graph per bucket of token counts replays the whole
forward in one launch instead.

A step is padded to its bucket's token count and to the graphs' fixed batch of `max_num_seqs + 1` sequences. The
padding tokens form one more sequence with no context: seq_len 0, so attention gives its rows zeros without reading
a key, and slot -1, so it writes no K/V. The sequences after it are empty. Padding rows still go through the dense
and expert layers (at most one bucket step of extra rows, finite values) and are never read.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from tidal.worker.engine.cuda_graphs import capture_graphs
from tidal.worker.engine.step_inputs import copy_token_inputs, step_inputs
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.memory.kv_region import KVCaches
from tidal.worker.models.base import CausalLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as GraphPool  # what torch.cuda.graph_pool_handle() returns

log = logging.getLogger(__name__)

# Small steps double; above, a bucket every BUCKET_STEP tokens bounds the padding at one step's worth of rows.
SMALL_BUCKETS = (16, 32, 64, 128)
BUCKET_STEP = 128


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts graphs are captured at, ascending, the last one `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes = [s for s in SMALL_BUCKETS if s < max_tokens]
    sizes += list(range(2 * SMALL_BUCKETS[-1], max_tokens, BUCKET_STEP))
    return [*sizes, max_tokens]


class PrefillGraphs:
    """Graphs of steps that are not decode-only, for up to `max_tokens` tokens over up to `max_num_seqs` sequences.

    `prepare` fills the static inputs from a plan (the same work with or without graphs), `forward` is the captured
    computation, `run` is the two with a replay between; a CPU test runs `prepare` then `forward` to check the
    padding without a GPU."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCaches,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_tokens: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = token_buckets(max_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks_per_seq
        n, batch = self.sizes[-1], max_num_seqs + 1  # + the padding sequence
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [N]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # [N]
        self.cu_seqlens_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)  # [B + 1]
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.zeros((batch, max_blocks_per_seq), dtype=torch.int32, device=device)  # [B, blocks]
        # One output for every bucket, made by the first forward: a fresh output per graph would stay allocated per
        # bucket (the sum of the sizes in rows, ~2 GiB of an 8B model's hidden states for buckets up to 8192).
        self._hidden: torch.Tensor | None = None  # [N, H]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0  # the last capture's, warm-ups and kernel compiles included

    def size_for(self, num_tokens: int) -> int:
        """The smallest bucket that holds `num_tokens`."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def can_run(self, plan: StepPlan) -> bool:
        return (
            not plan.is_decode_only
            and plan.num_tokens <= self.sizes[-1]
            and plan.num_seqs <= self.max_num_seqs
            and max(map(len, plan.block_tables)) <= self.max_blocks
        )

    @torch.inference_mode()
    def capture(self, pool: GraphPool) -> None:
        start = time.monotonic()
        self._graphs, _ = capture_graphs(self.sizes, self.forward, pool, self._only_padding)  # outputs: _hidden's
        self.capture_seconds = time.monotonic() - start
        log.info("captured CUDA graphs for prompt steps of %s tokens in %.1fs", self.sizes, self.capture_seconds)

    def run(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """-> hidden [T, H] of the plan's tokens (a view into the graph's output: use it before the next run)."""
        if self._hidden is None:  # made by the capture's first forward
            raise RuntimeError("the prompt-step graphs are not captured")
        self._graphs[self.prepare(plan, previous_tokens)].replay()
        return self._hidden[: plan.num_tokens]

    def prepare(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> int:
        """Copy `plan` into the static inputs, padded as the module docstring says. -> the bucket to run.
        `previous_tokens` [S'] on the device: the previous step's sampled tokens, for the plan's unknown inputs."""
        if not self.can_run(plan):
            raise ValueError(
                f"a step of {plan.num_tokens} tokens over {plan.num_seqs} sequences does not fit these graphs "
                f"(prompt steps of up to {self.sizes[-1]} tokens over up to {self.max_num_seqs} sequences)"
            )
        num_tokens, num_seqs = plan.num_tokens, plan.num_seqs
        size = self.size_for(num_tokens)
        width = max(map(len, plan.block_tables))
        inputs = step_inputs(plan, width, self.input_ids.device)
        copy_token_inputs(inputs, self.input_ids, self.positions, self.slot_mapping, previous_tokens)
        self.slot_mapping[num_tokens:size].fill_(-1)  # padding tokens write no K/V
        self.cu_seqlens_q[: num_seqs + 1].copy_(inputs.cu_seqlens_q)  # int64 -> int32
        self.cu_seqlens_q[num_seqs + 1 :].fill_(size)  # the padding sequence, then empty ones
        self.seq_lens[:num_seqs].copy_(inputs.seq_lens)
        self.seq_lens[num_seqs:].zero_()  # no context: attention reads nothing for them
        self.block_tables[:num_seqs, :width].copy_(inputs.block_tables)
        # The padding tokens' input ids and positions are whatever an earlier step left: valid ids and positions.
        return size

    def _only_padding(self, size: int) -> None:
        """Inputs for the capture's own runs: all `size` tokens are the padding sequence (no writes, zero attention),
        so no row of them is left to uninitialised attention output on the way through the expert layers."""
        self.slot_mapping[:size].fill_(-1)
        self.cu_seqlens_q.fill_(size)
        self.cu_seqlens_q[0] = 0
        self.seq_lens.zero_()

    def forward(self, size: int) -> torch.Tensor:
        """The captured computation: hidden [size, H] from the static inputs' first `size` tokens, into the one output
        buffer."""
        batch = AttentionBatch(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables,
            cu_seqlens_q=self.cu_seqlens_q,
            seq_lens=self.seq_lens,
            is_decode_only=False,
            kv_caches=self.kv_caches,
        )
        hidden: torch.Tensor = self.model(self.input_ids[:size], self.positions[:size], batch)
        if self._hidden is None:  # the first forward, a warm-up outside any capture
            self._hidden = torch.empty((self.sizes[-1], hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        out = self._hidden[:size]
        out.copy_(hidden)
        return out
