"""Llama (1/2/3, including Llama-3 rope scaling through the spec's rope_scaling)."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.models.decoder import DecoderForCausalLM, DecoderSpec, llama_like_spec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return llama_like_spec(cfg, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))
