"""Mixtral: the Mistral layout with a sparse block of experts (`block_sparse_moe`, experts w1/w3/w2) in every
layer; the top-k routing weights are always rescaled to sum to one."""

from __future__ import annotations

from transformers import PretrainedConfig

from tidal.worker.layers.moe import ExpertCheckpointNames, MoeSpec
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

MIXTRAL_EXPERT_NAMES = ExpertCheckpointNames(block="block_sparse_moe", router="gate", gate="w1", up="w3", down="w2")


class MixtralForCausalLM(MoeDecoderForCausalLM):
    @classmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec:
        return MoeSpec(
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            expert_intermediate_size=cfg.intermediate_size,
            renormalize=True,
            names=MIXTRAL_EXPERT_NAMES,
        )
