"""Qwen2: the Llama layout with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.models.decoder import DecoderForCausalLM, DecoderSpec, llama_like_spec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        return llama_like_spec(cfg, qkv_bias=True)
