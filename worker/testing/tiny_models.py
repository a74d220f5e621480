"""Tiny random models of every supported architecture, written as real Hugging Face model directories.

    python -m tidal.worker.testing.tiny_models --arch llama --out /tmp/tiny-llama [--sharded] [--tie-embeddings]

Each directory holds config.json (written by transformers' config class), safetensors weights (one file, or
shards with model.safetensors.index.json), and a locally trained byte-level BPE tokenizer with a chat template,
so both our engine and transformers' AutoModelForCausalLM/AutoTokenizer load it offline. The weights' names and
shapes come from our model implementation; the tests check transformers loads them with nothing missing.
Weights are scaled so logits are well separated (greedy comparisons are not decided by rounding).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tidal.worker.models.registry import resolve_model_class
from tidal.worker.testing.tiny_tokenizer import BOS, EOS, IM_END, PAD, save_tokenizer

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class TinyArch:
    # The architecture's config class; called with its fields as keywords, which the base class does not declare.
    config_class: Callable[..., PretrainedConfig]
    architecture: str
    extra: dict[str, Any] = field(default_factory=dict)


TINY_ARCHS: Mapping[str, TinyArch] = MappingProxyType(
    {
        "llama": TinyArch(
            LlamaConfig, "LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        ),
        "llama3": TinyArch(
            LlamaConfig,
            "LlamaForCausalLM",
            {
                "num_hidden_layers": 3,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
        ),
        "mistral": TinyArch(MistralConfig, "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
        "qwen2": TinyArch(Qwen2Config, "Qwen2ForCausalLM", {"use_sliding_window": False}),
        # head_dim 32 with 4 heads: q is wider than hidden (64), as Qwen3 allows.
        "qwen3": TinyArch(Qwen3Config, "Qwen3ForCausalLM", {"head_dim": 32, "attention_bias": False}),
        # The mixtures of experts: 8 experts, top-2, narrow experts so the CPU tests stay quick.
        "mixtral": TinyArch(
            MixtralConfig,
            "MixtralForCausalLM",
            {
                "sliding_window": None,
                "head_dim": 16,
                "intermediate_size": 32,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },
        ),
        "qwen2_moe": TinyArch(
            Qwen2MoeConfig,
            "Qwen2MoeForCausalLM",
            {
                "use_sliding_window": False,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "norm_topk_prob": False,
            },
        ),
        # Four layers, of which `mlp_only_layers` makes layer 2 dense (intermediate_size 128); top-k renormalised.
        "qwen3_moe": TinyArch(
            Qwen3MoeConfig,
            "Qwen3MoeForCausalLM",
            {
                "head_dim": 32,
                "attention_bias": False,
                "num_hidden_layers": 4,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [2],
            },
        ),
    }
)


def tiny_config(
    arch: str,
    vocab_size: int,
    special_ids: dict[str, int],
    tie_embeddings: bool,
    overrides: dict[str, Any] | None = None,
) -> PretrainedConfig:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(TINY_ARCHS)}")
    spec = TINY_ARCHS[arch]
    kwargs = {**COMMON, **spec.extra, **(overrides or {})}
    return spec.config_class(
        **kwargs,
        vocab_size=vocab_size,
        architectures=[spec.architecture],
        tie_word_embeddings=tie_embeddings,
        bos_token_id=special_ids[BOS],
        eos_token_id=[special_ids[EOS], special_ids[IM_END]],
        pad_token_id=special_ids[PAD],
        dtype="float32",
    )


def random_weights(names_and_shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(names_and_shapes.items()):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        else:  # [out, in] matrices: unit-variance outputs for unit-variance inputs
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        weights[name] = t.contiguous()
    return weights


def save_weights(weights: dict[str, torch.Tensor], out: Path, sharded: bool) -> None:
    if not sharded:
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(weights)
    num_shards = 3
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: weights[n] for n in names[i::num_shards]}
        save_file(shard, out / shard_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shard_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):  # one token gives one id; the annotation also covers a list of tokens
        raise TypeError(f"{token!r} has no single id: {token_id!r}")
    return token_id


def write_tiny_model(
    arch: str,
    out: Path | str,
    *,
    sharded: bool = False,
    tie_embeddings: bool = False,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """`config_overrides` changes sizes (hidden_size, num_hidden_layers, ...) for benchmarks."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out)
    special_ids = {t: _token_id(tokenizer, t) for t in (BOS, EOS, IM_END, PAD)}
    config = tiny_config(arch, len(tokenizer), special_ids, tie_embeddings, config_overrides)
    config.save_pretrained(out)
    # Our implementation names the checkpoint tensors exactly as transformers does (checked in the tests).
    with torch.device("meta"):
        model = resolve_model_class(config.architectures).from_hf_config(config, torch.float32, torch.device("meta"))
    shapes = {name: tuple(t.shape) for name, t in model.checkpoint_weights().items()}
    save_weights(random_weights(shapes, seed), out, sharded)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random Hugging Face model directory.")
    parser.add_argument("--arch", required=True, choices=sorted(TINY_ARCHS))
    parser.add_argument("--out", required=True, type=Path, help="directory to write (created if missing)")
    parser.add_argument("--sharded", action="store_true", help="split the weights into 3 shards with an index")
    parser.add_argument("--tie-embeddings", action="store_true", help="share the embedding with the LM head")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_model(
        args.arch, args.out, sharded=args.sharded, tie_embeddings=args.tie_embeddings, seed=args.seed
    )
    print(path)


if __name__ == "__main__":
    main()
