"""The dense pre-norm decoder shared by the Llama-like families (Llama, Mistral, Qwen2, Qwen3).

A family file turns its Hugging Face config into a `DecoderSpec` (what differs: biases, q/k norm, rope); the
layers here do the rest. A mixture-of-experts family overrides `CausalLM.make_mlp` to put its expert layer in
place of the dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn
from transformers import PretrainedConfig

from tidal.kernels.small_batch_linear import uses_small_batch_kernels
from tidal.worker.layers.attention import AttentionBatch, PagedAttention
from tidal.worker.layers.embedding import LMHead, VocabEmbedding
from tidal.worker.layers.linear import Linear, MergedLinear
from tidal.worker.layers.mlp import GatedMLP
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.models.base import CausalLM, KVCacheSpec
from tidal.worker.models.small_batch import small_batch_forward


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "default" | "linear" | "llama3", ...}
    rotary_dim: int
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope


def rope_settings(cfg: PretrainedConfig, head_dim: int) -> tuple[float, dict[str, Any] | None, int]:
    """(theta, scaling dict or None, rotary_dim) from transformers' `rope_parameters` (v5) or the older fields."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (params if rope_type != "default" else None), int(head_dim * partial)


def llama_like_spec(cfg: PretrainedConfig, **overrides: Any) -> DecoderSpec:
    """The spec fields every Llama-like config spells the same way; families pass what differs."""
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    theta, scaling, rotary_dim = rope_settings(cfg, head_dim)
    fields: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": num_heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rotary_dim": rotary_dim,
        "max_position": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }
    fields.update(overrides)
    return DecoderSpec(**fields)


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        parts = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        self.qkv_proj = MergedLinear(spec.hidden_size, parts, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype, device)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.rotary_emb = RotaryEmbedding(
            spec.rotary_dim, spec.max_position, spec.rope_theta, spec.rope_scaling, True, dtype, device
        )
        self.attn = PagedAttention(layer_idx, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.o_proj(self.attend_qkv(positions, self.qkv_proj(hidden), batch))

    def attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] -> attention output [T, q_size], before o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward_heads(q), self.k_norm.forward_heads(k)
        q = self.rotary_emb.rotate_and_store(positions, q, k, v, self.attn.kv_cache(batch), batch.slot_mapping)
        out = self.attn.attend(q, batch)  # [T, num_heads, head_dim]
        return out.reshape(num_tokens, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: DecoderSpec, layer_idx: int, mlp: nn.Module, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, layer_idx, dtype, device)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream before it), both [T, H]; the next norm adds them."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, mlps: list[nn.Module], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, mlp, dtype, device) for i, mlp in enumerate(mlps))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # The fused small-batch layers fold the RMSNorms into the dense MLP's projections; an expert layer has its
        # own router in between, so a mixture-of-experts model keeps the unfused layers.
        self.fuses_small_batches = all(isinstance(mlp, GatedMLP) for mlp in mlps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        if self.fuses_small_batches and uses_small_batch_kernels(hidden):
            return small_batch_forward(self, hidden, positions, batch)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """Module paths equal the Hugging Face checkpoint's names (model.layers.N.self_attn..., lm_head)."""

    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        return llama_like_spec(cfg)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> Self:
        return cls(cls.spec_from_config(hf_config), dtype, device)

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        mlps = [self.make_mlp(spec, i, dtype, device) for i in range(spec.num_layers)]
        self.model = DecoderModel(spec, mlps, dtype, device)
        tied = self.model.embed_tokens if spec.tie_word_embeddings else None
        self.lm_head = LMHead(spec.vocab_size, spec.hidden_size, dtype, device, tied_to=tied)

    def make_mlp(self, spec: DecoderSpec, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
        return super().ignored_checkpoint_tensor(name) or (self.spec.tie_word_embeddings and name == "lm_head.weight")
