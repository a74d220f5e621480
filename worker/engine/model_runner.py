"""All device work of a step: turn a StepPlan into tensors, run the model's forward, return logits to sample.

The runner owns the engine's device memory: the weights' region (made by the loader) and the KV cache's region,
which it takes once from the same memory provider, then captures CUDA graphs over both. The lifecycle releases and
restores those regions (`weights_region`, `kv_cache_region`) but changes nothing here; after a restore that moved them
(torch storage on CUDA, where virtual memory is unavailable) it asks for `recapture_graphs_if_moved`.
With expert parallelism a rank with nothing of its own to run still runs `execute_empty` with its group, in lockstep.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from tidal.worker.engine.cuda_graphs import DecodeGraphs, graph_pool_estimate
from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.kv_cache import throwaway_kv_caches
from tidal.worker.engine.prefill_graphs import PrefillGraphs
from tidal.worker.engine.step_inputs import fill_unknown_inputs, step_inputs
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.layers.expert_exchange import ExchangeSnapshot
from tidal.worker.loader.model_loader import LoadedModel
from tidal.worker.memory.kv_region import KVCacheRegion, KVCaches
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, device: torch.device, block_size: int, kv_cache_dtype: torch.dtype | None = None
    ) -> None:
        """`kv_cache_dtype`: the KV cache's element type, the activations' dtype by default (or FP8 e4m3)."""
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.kv_cache_dtype = kv_cache_dtype if kv_cache_dtype is not None else loaded.dtype
        self.device = device
        self.block_size = block_size
        self.weights_region = loaded.weights
        self._memory_provider = loaded.memory_provider
        self.kv_cache_region: KVCacheRegion | None = None
        self.kv_caches: KVCaches = []  # views into kv_cache_region, per layer
        self.num_kv_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_pool_bytes = 0  # device memory the graphs' pool holds, measured at capture
        self.graph_pool_estimate_bytes = 0  # what the KV cache's sizing held back for that pool
        # (max_num_seqs, max_model_len, prefill_tokens) the graphs were made for
        self._graph_shape: tuple[int, int, int] | None = None
        self._graph_addresses: tuple[int, int] | None = None  # the regions' addresses the graphs were captured at

    @property
    def bytes_per_block(self) -> int:
        return self.model.kv_cache_spec.bytes_per_block(self.block_size, self.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Take the KV cache's region from the memory provider, once."""
        if self.kv_cache_region is not None:
            raise RuntimeError("the KV cache is allocated already")
        spec = self.model.kv_cache_spec
        block_shape = (self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache_region = KVCacheRegion(
            self._memory_provider, spec.num_layers, block_shape, num_blocks, self.kv_cache_dtype, self.device
        )
        self.kv_caches = self.kv_cache_region.caches
        self.num_kv_blocks = num_blocks
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
            num_blocks,
            self.block_size,
            self.kv_cache_region.nbytes / 2**20,
            type(self.kv_cache_region.region).__name__,
        )

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, prefill_tokens: int = 0) -> None:
        """Record decode steps of up to `max_num_seqs` sequences as CUDA graphs (after the KV cache exists), and
        with `prefill_tokens` > 0 steps with prompt tokens of up to that many tokens (prefill_graphs.py)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if self.kv_cache_region is None:
            raise RuntimeError("the KV cache is not allocated")
        # A recapture: the old graphs' pool goes before the new one is taken.
        self.decode_graphs = None
        self.prefill_graphs = None
        max_blocks = -(-max_model_len // self.block_size)
        decode = DecodeGraphs(self.model, self.kv_caches, self.device, max_num_seqs, max_blocks)
        prefill = None
        if prefill_tokens > 0:
            prefill = PrefillGraphs(self.model, self.kv_caches, self.device, max_num_seqs, max_blocks, prefill_tokens)
        with torch.cuda.device(self.device):
            # Emptied before and after, torch's cache holds nothing of the warm-ups: what the device reservation
            # grows by is the graphs' pool (live graphs keep it through empty_cache). Garbage goes first: entering
            # a capture collects it too, and the pools of dead graphs (an earlier engine's, this runner's old set
            # held in a cycle) freed in there would net off against this pool (a CUDA test measured 0 bytes).
            gc.collect()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
            pool = torch.cuda.graph_pool_handle()
            if prefill is not None:  # first: the largest activations, which the decode graphs then reuse
                prefill.capture(pool)
            decode.capture(pool)
            torch.cuda.empty_cache()
            self.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info(
            "the CUDA graphs' memory pool holds %.2f GiB (%.2f GiB was held back for it)",
            self.graph_pool_bytes / 2**30,
            self.graph_pool_estimate_bytes / 2**30,
        )
        self.decode_graphs = decode
        self.prefill_graphs = prefill
        self._graph_shape = (max_num_seqs, max_model_len, prefill_tokens)
        self._graph_addresses = self._memory_addresses()

    def recapture_graphs_if_moved(self) -> bool:
        """After the regions were restored: capture the graphs again if a region came back at another address
        (the graphs replay the addresses they were captured at). -> whether it recaptured. Call it between steps."""
        if self._graph_shape is None or self._graph_addresses == self._memory_addresses():
            return False
        start = time.monotonic()
        self.capture_cuda_graphs(*self._graph_shape)
        log.info("memory moved across the sleep: CUDA graphs recaptured in %.2fs", time.monotonic() - start)
        return True

    def _memory_addresses(self) -> tuple[int, int]:
        kv_address = self.kv_cache_region.data_ptr() if self.kv_cache_region is not None else 0
        return self.weights_region.data_ptr(), kv_address

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """-> logits [S + P, V] (the model's dtype) of the plan's sampled rows then its prompt-logprob rows (P is
        almost always 0), or None when there are none. Only queues the work on a GPU. `previous_tokens` [S'] int64
        on the device: what the previous step sampled, where the plan's unknown input tokens come from (async
        scheduling)."""
        if not self.kv_caches:
            raise RuntimeError("the KV cache is not allocated")
        if plan.unknown_rows and previous_tokens is None:
            raise ValueError("the plan takes input tokens from the previous step's, and none were given")
        return self._forward(plan, self.kv_caches, previous_tokens)

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """A lockstep group's empty step (expert parallelism): this rank has no tokens, but its MoE layers still
        serve the tokens its peers send to the experts it holds, in layer order, as a full forward would."""
        if not isinstance(self.model, MoeDecoderForCausalLM) or self.model.expert_parallel is None:
            raise RuntimeError("an empty step needs a model built for expert parallelism")
        self.model.run_empty_moe_step()

    def expert_exchanges(self) -> ExchangeSnapshot | None:
        """What this rank's MoE layers exchanged with their group (None without expert parallelism)."""
        if not isinstance(self.model, MoeDecoderForCausalLM) or self.model.expert_parallel is None:
            return None
        return self.model.expert_parallel.exchange.snapshot()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer, (source, destination) pairs: a forked sample's own copy of the block
        its prompt ends in (copy-on-write). Queued behind the step that wrote the sources, on the same stream."""
        if not copies:
            return
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            pairs = to_device(int64_tensor([b for pair in copies for b in pair]), self.device).view(-1, 2)  # [C, 2]
            sources, destinations = pairs[:, 0], pairs[:, 1]
            for k_cache, v_cache in self.kv_caches:  # each [num_blocks, block_size, kv_heads, head_dim]
                for cache in (k_cache, v_cache):
                    raw = cache.view(torch.uint8)  # bytes: torch's index_copy_ has no FP8 kernel (on CPU)
                    raw.index_copy_(0, destinations, raw.index_select(0, sources))

    def synchronize(self) -> None:
        """Wait until the device has done all the work queued so far (not on the step path: see SampledTokens)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def estimate_graph_pool(
        self, max_num_seqs: int, max_model_len: int, prefill_tokens: int = 0, prefill_peak: int | None = None
    ) -> int:
        """-> the bytes to hold back for the CUDA graphs' pool when the KV cache is sized, and keep it in
        `graph_pool_estimate_bytes`. The pool is private to the graphs: the activations torch's cache kept from the
        profiling run are not reused for it, so without this a cache sized close to the device's limit leaves the
        capture out of memory. Graphs sharing one pool reuse each other's activations, so the pool starts from
        those of the largest captured step: the larger of a profiled decode step of `max_num_seqs` sequences and a
        prompt step of `prefill_tokens` tokens (`prefill_peak`: that step's profiled peak, when the caller has it
        already). `cuda_graphs.graph_pool_estimate` adds what the pool was measured to hold beyond them (the decode
        graphs' outputs, the allocator's fragmentation). On the high side, as wanted: a profiled step also counts
        its logits, which the graphs leave to the eager path.

        The decode profile runs at a context of one token, so it takes no split-K attention workspace, which the
        graphs (captured for `max_model_len`) do at small batches. That workspace is left to the slack:
        splits are chosen to give about PROGRAMS_PER_SM programs per multiprocessor (kernels/decode_attention.py),
        so it holds at most about 2 x 3 x SMs x (query heads / KV heads) x head_dim x 4 bytes, 1.6 MB on an H200
        for 4 query heads of 128 per KV head, and each layer's is freed before the next layer's is taken."""
        peak = self.profile(max_num_seqs, max_num_seqs, max_model_len)
        if prefill_tokens > 0:
            if prefill_peak is None:
                prefill_peak = self.profile(prefill_tokens, max_num_seqs, max_model_len)
            peak = max(peak, prefill_peak)
        row_bytes = self.model.hidden_size * self.dtype.itemsize
        estimate = graph_pool_estimate(peak, max_num_seqs, row_bytes)
        self.graph_pool_estimate_bytes = estimate
        return estimate

    @torch.inference_mode()
    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
        """Run a worst-case step (the most tokens, spread over the most sequences) on a throwaway cache so the
        allocator reserves its activations before the KV cache is sized. -> the step's peak activation bytes on
        CUDA (0 elsewhere)."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq = min(max_model_len, -(-num_tokens // num_seqs))
        num_blocks = -(-per_seq // self.block_size)
        caches = throwaway_kv_caches(
            self.model.kv_cache_spec, num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
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
            before = torch.cuda.memory_allocated(self.device)  # + the throwaway cache; the weights unless in VMM
        self._forward(plan, caches)
        del caches
        if not is_cuda:
            return 0
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
        return peak - before

    def _forward(
        self, plan: StepPlan, kv_caches: KVCaches, previous_tokens: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        # The current CUDA device is per thread (the step loop runs on its own) and Triton launches on it.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._forward_on_device(plan, kv_caches, previous_tokens)

    def _forward_on_device(
        self, plan: StepPlan, kv_caches: KVCaches, previous_tokens: torch.Tensor | None
    ) -> torch.Tensor | None:
        if kv_caches is self.kv_caches:  # not the profiling run's throwaway cache
            if self.decode_graphs is not None and self.decode_graphs.can_run(plan):
                hidden = self.decode_graphs.run(plan, previous_tokens)  # [B, H], one row per sequence
                return self._logits(hidden, plan)
            if self.prefill_graphs is not None and self.prefill_graphs.can_run(plan):
                hidden = self.prefill_graphs.run(plan, previous_tokens)  # [T, H]
                return self._logits(hidden, plan)
        # Padding entries are never read. A power-of-two width keeps the number of distinct shapes (and so of
        # Triton specialisations compiled on the way) logarithmic in the context length.
        width = 1 << (max(map(len, plan.block_tables)) - 1).bit_length()
        inputs = step_inputs(plan, width, self.device)
        fill_unknown_inputs(inputs.input_ids, inputs, previous_tokens)
        batch = AttentionBatch(
            slot_mapping=inputs.slot_mapping,  # [T]
            block_tables=inputs.block_tables.to(torch.int32),  # [B, width]
            cu_seqlens_q=inputs.cu_seqlens_q.to(torch.int32),  # [B + 1]
            seq_lens=inputs.seq_lens.to(torch.int32),  # [B]
            is_decode_only=plan.is_decode_only,
            kv_caches=kv_caches,
        )
        hidden = self.model(inputs.input_ids, inputs.positions, batch)  # [T, H]
        return self._logits(hidden, plan)

    def _logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor | None:
        indices = plan.sample_indices
        if plan.prompt_logit_rows:  # a sequence asks for its prompt's logprobs: those positions' logits too
            indices = indices + plan.prompt_logit_rows
        if not indices:
            return None
        if indices is plan.sample_indices and len(indices) == hidden.shape[0]:  # every row samples (decode)
            return self.model.compute_logits(hidden)  # [S, V]
        # Through pinned memory: torch.tensor(..., device=cuda) would wait for the device to finish the step.
        rows = to_device(int64_tensor(indices), self.device)  # [S + P]
        return self.model.compute_logits(hidden.index_select(0, rows))  # [S + P, V]
