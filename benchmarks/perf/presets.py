"""Model shape presets and workloads of the performance benchmark (typed, validated when built).

A preset names a shape, not a checkpoint: the benchmark writes config.json and the tiny tokenizer to a directory
through tidal.worker.testing.tiny_models' public functions, and fills the weights in memory (random_model.py).
The tokenizer knows 512 tokens; a model with a larger vocabulary samples ids the tokenizer decodes to nothing,
which costs the detokenizer the same work and does not matter with ignore_eos and a fixed token count.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.worker.testing.tiny_models import TINY_ARCHS, tiny_config
from tidal.worker.testing.tiny_tokenizer import BOS, EOS, IM_END, PAD, save_tokenizer


class ModelPreset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    arch: str = Field(description="a tiny_models architecture key: config class, architecture name, rope style")
    vocab_size: int | None = Field(default=None, description="None: the tiny tokenizer's own size")
    overrides: dict[str, Any] = Field(default_factory=dict, description="config fields over the tiny defaults")
    gpu_workload: str = Field(default="dense", description="which GPU workload it runs: a key of GPU_WORKLOADS")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.arch not in TINY_ARCHS:
            raise ValueError(f"preset {self.name}: unknown arch {self.arch!r}; choose from {', '.join(TINY_ARCHS)}")
        if self.gpu_workload not in ("dense", "moe"):
            raise ValueError(f"preset {self.name}: gpu_workload must be 'dense' or 'moe', got {self.gpu_workload!r}")
        return self


# Llama-3-8B's published shape (8.03e9 parameters, 16.06 GB in bf16).
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},  # Llama-3 (3.1 added long-context scaling)
}

# Qwen3-30B-A3B's published shape: 48 layers, every one sparse, 128 experts of width 768, top-8 renormalised
# (30.5e9 parameters, 3.3e9 active; ~61 GB in bf16).
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,  # the dense MLP's width, which no layer uses (mlp_only_layers is empty)
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
# Mixtral-8x7B's published shape: 8 experts of width 14336, top-2 (46.7e9 parameters, 12.9e9 active; ~93 GB).
MIXTRAL_8X7B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}

PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {
        "tiny": ModelPreset(name="tiny", arch="llama3"),
        "tiny-moe": ModelPreset(name="tiny-moe", arch="qwen3_moe", gpu_workload="moe"),
        "llama3-8b": ModelPreset(name="llama3-8b", arch="llama3", vocab_size=128256, overrides=LLAMA3_8B),
        "qwen3-30b-a3b": ModelPreset(
            name="qwen3-30b-a3b", arch="qwen3_moe", vocab_size=151936, overrides=QWEN3_30B_A3B, gpu_workload="moe"
        ),
        "mixtral-8x7b": ModelPreset(
            name="mixtral-8x7b", arch="mixtral", vocab_size=32000, overrides=MIXTRAL_8X7B, gpu_workload="moe"
        ),
    }
)


def write_model_dir(preset: ModelPreset, out: Path) -> Path:
    """config.json + tokenizer for `preset` in `out` (no weights: random_model.py makes them in memory)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out)
    special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, IM_END, PAD)}
    vocab_size = preset.vocab_size or len(tokenizer)
    config = tiny_config(preset.arch, vocab_size, special_ids, tie_embeddings=False, overrides=preset.overrides)
    config.save_pretrained(out)
    return out


def check_decode_timing(warmup_tokens: int, new_tokens: int) -> None:
    """A decode run times the tokens after its warm-up ones: there must be some."""
    if warmup_tokens >= new_tokens:
        raise ValueError(
            f"decode_warmup_tokens ({warmup_tokens}) must be below decode_new_tokens ({new_tokens}): "
            "nothing would be timed"
        )


class Workload(BaseModel):
    """What both implementations run. Decode figures are steady state: of `decode_new_tokens` generated after a
    `decode_prompt_len` prompt, the first `decode_warmup_tokens` are not timed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decode_batches: list[int] = Field(min_length=1)
    transformers_decode_batches: list[int] = Field(min_length=0)
    decode_prompt_len: int = Field(ge=1)
    decode_new_tokens: int = Field(ge=2)
    decode_warmup_tokens: int = Field(ge=1)
    ttft_prompt_len: int = Field(ge=1)
    ttft_repeats: int = Field(ge=1)
    offline_requests: int = Field(ge=1)
    offline_input_len: int = Field(ge=1)
    offline_output_len: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_decode_timing(self.decode_warmup_tokens, self.decode_new_tokens)
        if any(b < 1 for b in self.decode_batches + self.transformers_decode_batches):
            raise ValueError("decode batch sizes must be >= 1")
        return self

    @property
    def max_num_seqs(self) -> int:
        return max(*self.decode_batches, self.offline_requests)

    @property
    def longest_sequence(self) -> int:
        return max(
            self.decode_prompt_len + self.decode_new_tokens,
            self.ttft_prompt_len + 1,
            self.offline_input_len + self.offline_output_len,
        )


# The GPU workload: ~3 minutes of device time for the 8B shape, transformers included.
GPU_WORKLOAD = Workload(
    decode_batches=[1, 8, 32, 64],
    transformers_decode_batches=[1, 8, 32, 64],
    decode_prompt_len=128,
    decode_new_tokens=64,
    decode_warmup_tokens=16,
    ttft_prompt_len=1024,
    ttft_repeats=5,
    offline_requests=256,
    offline_input_len=256,
    offline_output_len=256,
)
# The same shape of run, small enough for 2 CPU cores (the torch reference attention loops over sequences).
CPU_WORKLOAD = Workload(
    decode_batches=[1, 8, 32],
    transformers_decode_batches=[1, 8, 32],
    decode_prompt_len=32,
    decode_new_tokens=24,
    decode_warmup_tokens=8,
    ttft_prompt_len=256,
    ttft_repeats=3,
    offline_requests=32,
    offline_input_len=64,
    offline_output_len=32,
)
SMOKE_WORKLOAD = Workload(
    decode_batches=[1, 3],
    transformers_decode_batches=[1, 3],
    decode_prompt_len=8,
    decode_new_tokens=6,
    decode_warmup_tokens=2,
    ttft_prompt_len=32,
    ttft_repeats=2,
    offline_requests=6,
    offline_input_len=12,
    offline_output_len=6,
)


# The MoE issue's decode batches go to 256, where a step touches nearly every expert of a layer; transformers'
# generate() runs to 64 (its expert loop launches a few kernels per expert touched, in Python).
MOE_GPU_WORKLOAD = GPU_WORKLOAD.model_copy(
    update={"decode_batches": [1, 8, 64, 256], "transformers_decode_batches": [1, 8, 64]}
)
GPU_WORKLOADS: Mapping[str, Workload] = MappingProxyType({"dense": GPU_WORKLOAD, "moe": MOE_GPU_WORKLOAD})


def default_workload(preset: ModelPreset, device_type: str, smoke: bool) -> Workload:
    if smoke:
        return SMOKE_WORKLOAD
    return GPU_WORKLOADS[preset.gpu_workload] if device_type == "cuda" else CPU_WORKLOAD


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids above the tokenizer's specials (ids < 10), the same on every run and for both sides."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(num)]
