"""Qwen2-MoE: the Qwen2 layout (q/k/v bias) with experts plus a shared expert behind a sigmoid gate; layers listed
in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.layers.moe import ExpertCheckpointNames, MoeSpec
from tidal.worker.models.decoder import DecoderSpec, llama_like_spec
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM, qwen_dense_mlp_layers

QWEN_MOE_EXPERT_NAMES = ExpertCheckpointNames(
    block="mlp", router="gate", gate="gate_proj", up="up_proj", down="down_proj"
)


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        return llama_like_spec(cfg, qkv_bias=bool(getattr(cfg, "qkv_bias", True)))

    @classmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_intermediate_size=cfg.moe_intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
            names=QWEN_MOE_EXPERT_NAMES,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        )

    @classmethod
    def dense_mlp_layers(cls, cfg: PretrainedConfig) -> frozenset[int]:
        return qwen_dense_mlp_layers(cfg)
