"""The engine's one typed configuration, validated when it is built (the worker's WorkerConfig nests it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "bfloat16", "float16", "float32"]
# "auto": the activations' dtype; the others name FP8 e4m3 (kernels/kv_cache_dtype.py: FP8_NAMES, checked by a test).
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
# "auto": the model dtype; "fp8": e4m3 projections (worker/layers/fp8_weights.py: WEIGHT_DTYPES, kept equal by a test).
WeightDType = Literal["auto", "fp8"]


class EngineConfig(BaseModel):
    """Everything the engine needs to load a model and size its KV cache.

    KV cache size: on CUDA it is `gpu_memory_fraction` of the memory still free after the weights are loaded
    and a worst-case forward has been profiled; on CPU it is `num_kv_blocks` or `kv_cache_bytes` (default
    512 MiB). `num_kv_blocks`, when set, wins on every device (tests use it to force preemption).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_path: Path = Field(
        description="Local Hugging Face model directory (config.json, *.safetensors, tokenizer); the worker also takes "
        "a .gguf file, dequantized once into a cached directory."
    )
    served_model_name: str | None = Field(default=None, description="Name reported to clients; default: folder name.")
    dtype: DType = Field(default="auto", description="Weight/activation dtype; 'auto' takes the checkpoint's dtype.")
    device: str = Field(default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    block_size: int = Field(default=16, ge=1, le=256, description="Tokens per KV cache block (a power of two).")
    kv_cache_dtype: KVCacheDType = Field(
        default="auto",
        description=(
            "KV cache element type: 'auto' (the activations' dtype) or 'fp8' / 'fp8_e4m3' (FP8 e4m3 without a scale:"
            " twice the tokens, half the bytes decode attention reads)."
        ),
    )
    weight_dtype: WeightDType = Field(
        default="auto",
        description=(
            "Weights of the attention and MLP projections: 'auto' (the model dtype) or 'fp8' (e4m3 with a scale per"
            " output channel, quantized as the checkpoint is read; activations quantized per token for the FP8 GEMMs"
            " above 16 rows): half the bytes, twice the tensor-core rate, for some precision. GPUs of compute"
            " capability 8.9+ (and CPUs)."
        ),
    )
    num_kv_blocks: int | None = Field(default=None, ge=1, description="Fixed number of KV cache blocks.")
    kv_cache_bytes: int | None = Field(default=None, ge=1, description="KV cache size in bytes (CPU).")
    gpu_memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0, description="Share of free GPU memory for KV.")
    max_num_seqs: int = Field(default=64, ge=1, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="Most tokens in one step (prefill chunks).")
    max_model_len: int | None = Field(default=None, ge=2, description="Longest sequence; default from the model.")
    seed: int = Field(
        default=0, ge=0, le=2**64 - 1, description="Seed of the sampler for requests that carry no seed of their own."
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of identical prompt prefixes.")
    enforce_eager: bool = Field(default=False, description="CUDA: run every step eagerly, without CUDA graphs.")
    # On by default since an H100 measured it: a 1024-token prompt's step took 2.06x less time replayed on the
    # Qwen3-30B-A3B shape and 1.10x on Llama-3-8B, for ~4-6 s of capture at start with cold kernel caches
    # (benchmarks/results/prefill-graphs-h100.md).
    cuda_graph_prefill_tokens: int = Field(
        default=2048, ge=0,
        description=(
            "CUDA: steps with prompt tokens, up to this many tokens in all (at most max_num_batched_tokens), replay a "
            "CUDA graph captured at the next bucketed count (16, 32, 64, 128, then every 128) instead of launching "
            "each kernel from the host; 0 runs them eagerly. Each bucket is captured at start; the largest one's "
            "activations stay reserved in the graphs' memory pool, asleep too."
        ),
    )  # fmt: skip
    async_scheduling: bool = Field(
        default=True,
        description=(
            "Launch each step before the host has read the previous step's sampled tokens (they are fed to the "
            "device from the device), so the host's work on a step overlaps the device's work on the next one. "
            "Outputs are the same as with False (one step at a time)."
        ),
    )
    # 50 ms: the slowest masks of admitted grammars that are not ambiguous took up to 31 ms a token at a 152k
    # vocabulary (three {1,16} letter classes 11 ms, 16 tags 18 ms, `w{1,100}` with a separator 31 ms), a JSON
    # schema's 20-55 us; the ambiguous shapes the admission estimate cannot see take 0.13-1.4 s
    # (benchmarks/results/grammar-compile-ebnf.md). A few decode steps' time, once per such request.
    grammar_mask_limit_ms: float = Field(
        default=50.0, gt=0.0,
        description=(
            "Structured outputs: the longest one request's grammar may take to fill its token mask for one step. "
            "Every step's sampling waits for all of its rows' masks, so a request past it is ended at once with an "
            "error naming the cause (an ambiguous grammar makes every mask slow), and the step goes on without "
            "waiting for the rest of its fill."
        ),
    )  # fmt: skip

    rank: int = Field(default=0, ge=0, description="This worker's rank in its expert-parallel group.")
    world_size: int = Field(
        default=1, ge=1, description="Ranks in this worker's group; above 1, a model's experts are spread over them."
    )
    redundant_experts_per_rank: int = Field(
        default=0, ge=0,
        description="Expert parallelism: expert slots per rank beyond an even share, for copies of experts.",
    )  # fmt: skip
    expert_slots_per_rank: int | None = Field(
        default=None, ge=1,
        description=(
            "Expert parallelism: expert slots of this rank, fixed for its life; default ceil(experts / world_size) + "
            "redundant_experts_per_rank. A rank joining a running group that was resized needs the count its "
            "members report (/state group.slots_per_rank)."
        ),
    )  # fmt: skip
    time_expert_exchanges: bool = Field(
        default=False,
        description=(
            "Expert parallelism: time each MoE layer's dispatch and combine (tidal_expert_exchange_seconds_total). "
            "Each then waits for the device to be idle before it starts, which costs the overlap of queueing it: "
            "for measuring where a step's time goes, not for serving."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of world_size {self.world_size}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("set at most one of num_kv_blocks and kv_cache_bytes")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.name

    @property
    def prefill_graph_tokens(self) -> int:
        """The most tokens of a prompt step that a CUDA graph serves (0: none); no step has more than
        max_num_batched_tokens."""
        return min(self.cuda_graph_prefill_tokens, self.max_num_batched_tokens)
