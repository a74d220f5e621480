"""All device work of a step: turn a StepPlan into tensors, run the model's forward, return logits to sample.

A follower rank of a group (later) runs `execute` on the plan it receives and ignores the logits.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from tidal.worker.engine.cuda_graphs import DecodeGraphs
from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.kv_cache import KVCaches, allocate_kv_caches
from tidal.worker.engine.step_plan import StepPlan, padded_block_tables
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.models.base import CausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.kv_caches: KVCaches = []
        self.num_kv_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None

    @property
    def bytes_per_block(self) -> int:
        return self.model.kv_cache_spec.bytes_per_block(self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model.kv_cache_spec, num_blocks, self.block_size, self.dtype, self.device
        )
        self.num_kv_blocks = num_blocks
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.bytes_per_block / 2**20,
        )

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Record decode steps of up to `max_num_seqs` sequences as CUDA graphs (after the KV cache exists)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.kv_caches, self.device, max_num_seqs, max_blocks)
        with torch.cuda.device(self.device):
            graphs.capture()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """-> logits [S, V] fp32 of the plan's sampled rows, or None when no sequence samples this step. Only
        queues the work on a GPU. `previous_tokens` [S'] int64 on the device: what the previous step sampled,
        where the plan's unknown input tokens come from (async scheduling)."""
        if not self.kv_caches:
            raise RuntimeError("the KV cache is not allocated")
        if plan.unknown_rows and previous_tokens is None:
            raise ValueError("the plan takes input tokens from the previous step's, and none were given")
        return self._forward(plan, self.kv_caches, previous_tokens)

    def synchronize(self) -> None:
        """Wait until the device has done all the work queued so far (not on the step path: see SampledTokens)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """Run a worst-case step (the most tokens, spread over the most sequences) on a throwaway cache so the
        allocator reserves its activations before the KV cache is sized."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq = min(max_model_len, -(-num_tokens // num_seqs))
        num_blocks = -(-per_seq // self.block_size)
        caches = allocate_kv_caches(self.model.kv_cache_spec, num_blocks, self.block_size, self.dtype, self.device)
        lens = [per_seq] * num_seqs
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        plan = StepPlan(
            seq_ids=list(range(num_seqs)),
            input_ids=[0] * cu[-1],
            positions=[p for n in lens for p in range(n)],
            slot_mapping=[-1] * cu[-1],  # write nothing: every sequence shares the throwaway blocks
            cu_seqlens_q=cu,
            seq_lens=lens,
            block_tables=[list(range(num_blocks))] * num_seqs,
            sample_indices=[c - 1 for c in cu[1:]],
            sample_seq_ids=list(range(num_seqs)),
        )
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)  # weights (+ the tiny throwaway cache)
        self._forward(plan, caches)
        del caches
        if is_cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            log.info(
                "profiling run (%d tokens over %d sequences): %.2f GiB allocated before, peak %.2f GiB "
                "(activations %.2f GiB); torch keeps %.2f GiB reserved for reuse",
                cu[-1],
                num_seqs,
                before / 2**30,
                peak / 2**30,
                (peak - before) / 2**30,
                torch.cuda.memory_reserved(self.device) / 2**30,
            )

    def _forward(
        self, plan: StepPlan, kv_caches: KVCaches, previous_tokens: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        # The current CUDA device is per thread (the step loop runs on its own) and Triton launches on it.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._forward_on_device(plan, kv_caches, previous_tokens)

    def _forward_on_device(
        self, plan: StepPlan, kv_caches: KVCaches, previous_tokens: torch.Tensor | None
    ) -> torch.Tensor | None:
        graphs = self.decode_graphs
        if graphs is not None and kv_caches is self.kv_caches and graphs.can_run(plan):
            hidden = graphs.run(plan, previous_tokens)  # [B, H], one row per sequence
            return self._logits(hidden, plan)
        # Every int input in one host tensor and (on a GPU) one copy, instead of a tensor and a copy each.
        num_tokens, num_seqs, num_unknown = plan.num_tokens, plan.num_seqs, len(plan.unknown_rows)
        # Padding entries are never read. A power-of-two width keeps the number of distinct shapes (and so of
        # Triton specialisations compiled on the way) logarithmic in the context length.
        width = 1 << (max(map(len, plan.block_tables)) - 1).bit_length()
        flat = plan.input_ids + plan.positions + plan.slot_mapping + plan.cu_seqlens_q + plan.seq_lens
        flat += padded_block_tables(plan.block_tables, width)
        flat += plan.unknown_rows + plan.unknown_sources
        packed = to_device(int64_tensor(flat), self.device)  # [3T + 2B + 1 + B * width + 2U]
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, tables, unknown_rows, unknown_sources = (
            packed.split(
                [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_unknown, num_unknown]
            )
        )
        if num_unknown:
            # The previous step's sampled tokens, still on the device: a gather queued behind that step.
            input_ids.index_copy_(0, unknown_rows, previous_tokens.index_select(0, unknown_sources))  # type: ignore[union-attr]
        batch = AttentionBatch(
            slot_mapping=slot_mapping,  # [T]
            block_tables=tables.view(num_seqs, width).to(torch.int32),  # [B, width]
            cu_seqlens_q=cu_seqlens_q.to(torch.int32),  # [B + 1]
            seq_lens=seq_lens.to(torch.int32),  # [B]
            is_decode_only=plan.is_decode_only,
            kv_caches=kv_caches,
        )
        hidden = self.model(input_ids, positions, batch)  # [T, H]
        return self._logits(hidden, plan)

    def _logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor | None:
        if not plan.sample_indices:
            return None
        if len(plan.sample_indices) == hidden.shape[0]:  # every row samples (decode): no gather needed
            return self.model.compute_logits(hidden)  # [S, V]
        # Through pinned memory: torch.tensor(..., device=cuda) would wait for the device to finish the step.
        rows = to_device(int64_tensor(plan.sample_indices), self.device)  # [S]
        return self.model.compute_logits(hidden.index_select(0, rows))  # [S, V]
