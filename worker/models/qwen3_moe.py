"""Qwen3-MoE: the Qwen3 layout (per-head q/k norm) with experts and no shared expert; `norm_topk_prob` rescales the
top-k routing weights, and layers listed in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.layers.moe import MoeSpec
from tidal.worker.models.decoder import DecoderSpec, llama_like_spec
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM, qwen_dense_mlp_layers
from tidal.worker.models.qwen2_moe import QWEN_MOE_EXPERT_NAMES


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return llama_like_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_intermediate_size=cfg.moe_intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
            names=QWEN_MOE_EXPERT_NAMES,
        )

    @classmethod
    def dense_mlp_layers(cls, cfg: PretrainedConfig) -> frozenset[int]:
        return qwen_dense_mlp_layers(cfg)
