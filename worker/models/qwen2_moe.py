"""Qwen2-MoE: the Qwen2 layout (q/k/v bias) with experts plus a shared expert behind a sigmoid gate; layers listed
in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.models.decoder import DecoderSpec, llama_like_spec
from tidal.worker.models.qwen_moe import QwenMoeForCausalLM


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        return llama_like_spec(cfg, qkv_bias=bool(getattr(cfg, "qkv_bias", True)))
