"""Qwen3: the Llama layout with RMSNorm over each head of q and k before rope, and an explicit head_dim."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.models.decoder import DecoderForCausalLM, DecoderSpec, llama_like_spec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return llama_like_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)
