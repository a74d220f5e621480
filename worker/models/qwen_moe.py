"""The Qwen MoE families' shared part (Qwen2-MoE, Qwen3-MoE): expert names on disk, the expert settings (a shared
expert where the config sizes one), and which layers keep a dense MLP. Each family adds its attention settings."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.layers.moe import ExpertCheckpointNames, MoeSpec
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

QWEN_MOE_EXPERT_NAMES = ExpertCheckpointNames(
    block="mlp", router="gate", gate="gate_proj", up="up_proj", down="down_proj"
)


def qwen_dense_mlp_layers(cfg: PretrainedConfig) -> frozenset[int]:
    """The Qwen MoE rule: a layer is sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step`."""
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    num_experts = int(cfg.num_experts)
    return frozenset(
        i for i in range(cfg.num_hidden_layers) if i in mlp_only or num_experts <= 0 or (i + 1) % step != 0
    )


class QwenMoeForCausalLM(MoeDecoderForCausalLM):
    @classmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_intermediate_size=cfg.moe_intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
            names=QWEN_MOE_EXPERT_NAMES,
            # Qwen2-MoE sizes a shared expert; Qwen3-MoE's config has no such field.
            shared_expert_intermediate_size=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0),
        )

    @classmethod
    def dense_mlp_layers(cls, cfg: PretrainedConfig) -> frozenset[int]:
        return qwen_dense_mlp_layers(cfg)
