"""Qwen3-MoE: the Qwen3 layout (per-head q/k norm) with experts and no shared expert; `norm_topk_prob` rescales the
top-k routing weights, and layers listed in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.models.decoder import DecoderSpec, llama_like_spec
from tidal.worker.models.qwen_moe import QwenMoeForCausalLM


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return llama_like_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)
