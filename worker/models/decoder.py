"""The dense pre-norm decoder shared by the Llama-like families (Llama, Mistral, Qwen2, Qwen3).

A family file turns its Hugging Face config into a `DecoderSpec` (what differs: biases, q/k norm, rope); the
layers here do the rest. A mixture-of-experts family overrides `CausalLM.make_mlp` to put its expert layer in
place of the dense MLP.

Each layer has two forwards over the same weight tensors (weight updates, sleep and checksums see one set): the
unfused one, and for a step of at most 16 tokens on a GPU in 16-bit the small-batch one, five launches a dense layer
(six an expert layer, its router's included) instead of twelve (`DecoderLayer.forward_small_batch`).
`DecoderModel.forward` picks one of them per step; an expert layer joins the small-batch path at the token counts
its small-batch expert kernels serve (SparseMoE.small_batch_config), and a step any layer cannot fuse runs unfused
throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from tidal.kernels.fp8_linear import QuantizedRows
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import NormInput, uses_small_batch_kernels
from tidal.kernels.small_batch_qkv import can_fuse_rotary, qkv_rope_store_triton
from tidal.worker.layers.attention import AttentionBatch, PagedAttention
from tidal.worker.layers.embedding import LMHead, VocabEmbedding
from tidal.worker.layers.expert_parallel import ExpertParallelSettings
from tidal.worker.layers.linear import Linear, MergedLinear
from tidal.worker.layers.mlp import GatedMLP
from tidal.worker.layers.moe import SparseMoE
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.models.base import CausalLM, KVCacheSpec


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
        # Whether the small-batch qkv kernel rotates q and k and writes the cache in its epilogue; a per-head q/k
        # norm (Qwen3) folds in too where one program can hold a whole head (head_dim 32 to 256).
        self.fuses_rotary_into_qkv = can_fuse_rotary(
            spec.head_dim, self.rotary_emb.rotary_dim, self.rotary_emb.is_neox, self.q_norm is not None
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor | QuantizedRows, batch: AttentionBatch
    ) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(self._attend_qkv(positions, self.qkv_proj(hidden), batch))
        return out

    def forward_small_batch(
        self,
        positions: torch.Tensor,
        x: NormInput,
        eps: float,
        residual: torch.Tensor,
        next_gamma: torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, NormInput]:
        """residual + forward(rms_norm(h)) for at most 16 rows, from the input norm's unscaled input `x` and its
        `eps`. -> (the new residual stream [T, H], the input of the next norm (weight `next_gamma`) over it)."""
        if self.fuses_rotary_into_qkv:
            k_cache, v_cache = self.attn.kv_cache(batch)
            q_norm, k_norm = self._head_norms()
            q = qkv_rope_store_triton(
                x.scaled, self.qkv_proj.weight, self.qkv_proj.bias, x.partial_sq, eps, positions,
                self.rotary_emb.cos_sin_cache, k_cache, v_cache, batch.slot_mapping, self.num_heads, self.num_kv_heads,
                q_norm, k_norm, weight_scale=self.qkv_proj.weight_scale,
            )  # fmt: skip
            out = self.attn.attend(q, batch).reshape(q.shape[0], self.q_size)  # [T, q_size]
        else:
            out = self._attend_qkv(positions, self.qkv_proj.forward_normed_rows(x, eps), batch)  # [T, q_size]
        return self.o_proj.forward_into_residual(out, residual, next_gamma)

    def _attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] -> attention output [T, q_size], before o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # Qwen3's per-head q/k norm runs inside the rotary+store kernel: one launch, not three.
        q_norm, k_norm = self._head_norms()
        kv_cache = self.attn.kv_cache(batch)
        q = self.rotary_emb.rotate_and_store(positions, q, k, v, kv_cache, batch.slot_mapping, q_norm, k_norm)
        out = self.attn.attend(q, batch)  # [T, num_heads, head_dim]
        return out.reshape(num_tokens, self.q_size)

    def _head_norms(self) -> tuple[HeadNorm | None, HeadNorm | None]:
        """Qwen3's per-head (q norm, k norm), applied by whichever kernel rotates; (None, None) for other models."""
        if self.q_norm is None or self.k_norm is None:
            return None, None
        return self.q_norm.head_norm(), self.k_norm.head_norm()


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: DecoderSpec, layer_idx: int, mlp: nn.Module, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, layer_idx, dtype, device)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def fuses_small_batch(self, num_tokens: int) -> bool:
        """Whether this layer has a small-batch forward for a step of `num_tokens` (at most 16): a dense MLP always
        does; an expert block where its small-batch expert kernels run at that count (not with expert parallelism
        or a shared expert, see SparseMoE.small_batch_config)."""
        if isinstance(self.mlp, SparseMoE):
            return self.mlp.small_batch_config(num_tokens) is not None
        return isinstance(self.mlp, GatedMLP)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream before it), both [T, H]; the next norm adds them."""
        # A projection with FP8 weights takes its input quantized by the norm before it (no launch of its own).
        quantize_qkv = self.self_attn.qkv_proj.takes_quantized_rows
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, quantize=quantize_qkv)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quantize=quantize_qkv)
        hidden = self.self_attn(positions, hidden, batch)
        quantize_mlp = isinstance(self.mlp, GatedMLP) and self.mlp.takes_quantized_rows
        hidden, residual = self.post_attention_layernorm(hidden, residual, quantize=quantize_mlp)
        return self.mlp(hidden), residual

    def forward_small_batch(
        self,
        positions: torch.Tensor,
        residual: torch.Tensor,
        x: NormInput,
        next_gamma: torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, NormInput]:
        """The same layer for at most 16 rows, on the small-batch kernels (tidal.kernels.small_batch_linear and
        small_batch_qkv), whose epilogues do the small op after each projection; no RMSNorm, SiLU-and-mul or split-K
        reduce is a launch of its own:

            qkv       linear_rows(h * gamma_in) scaled by 1/rms; (Qwen3: per-head q/k norm,) rotary on q and k,
                      k and v into the KV cache
            attention decode split (the last split merges), as unfused
            o         h <- h + o_proj(attention), also h * gamma_post and partial sums of h^2
            gate/up   silu(gate) * up of linear_rows(h * gamma_post) scaled by 1/rms
            down      h <- h + down_proj(act), also h * next_gamma and its partial sums

        `residual` [T, H] is the stream entering the layer and `x` its input norm's unscaled input (the previous
        layer's down projection wrote it); `next_gamma` is the weight of the norm after this layer. It rounds h * gamma
        where the unfused layers round normed h: the results agree to bf16 precision, not bit for bit.
        """
        residual, x = self.self_attn.forward_small_batch(
            positions, x, self.input_layernorm.eps, residual, self.post_attention_layernorm.gamma, batch
        )
        mlp = cast(GatedMLP | SparseMoE, self.mlp)  # the decoder takes this path only where `fuses_small_batch`
        return mlp.forward_small_batch(x, self.post_attention_layernorm.eps, residual, next_gamma)


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, mlps: list[nn.Module], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        layers = [DecoderLayer(spec, i, mlp, dtype, device) for i, mlp in enumerate(mlps)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        if uses_small_batch_kernels(hidden) and self._fuses_small_batch(hidden.shape[0]):
            return self._forward_small_batch(positions, hidden, batch)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        normed: torch.Tensor
        normed, _ = self.norm(hidden, residual)
        return normed

    def _fuses_small_batch(self, num_tokens: int) -> bool:
        # Every layer or none: the fused layers hand each other the next norm's input, the unfused ones a residual.
        return all(cast(DecoderLayer, layer).fuses_small_batch(num_tokens) for layer in self.layers)

    def _forward_small_batch(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """hidden [T, H] (the embeddings, T <= 16) -> the final normed hidden states [T, H]."""
        layers = cast("list[DecoderLayer]", list(self.layers))
        x = layers[0].input_layernorm.norm_input(hidden)
        residual = hidden
        for i, layer in enumerate(layers):
            # The last layer's epilogue prepares the final norm's input; the final norm's own kernel normalises below
            # instead, rounding exactly as the unfused path does before the LM head.
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            residual, x = layer.forward_small_batch(positions, residual, x, next_norm.gamma, batch)
        hidden = self.norm(residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """Module paths equal the Hugging Face checkpoint's names (model.layers.N.self_attn..., lm_head)."""

    @classmethod
    def spec_from_config(cls, cfg: PretrainedConfig) -> DecoderSpec:
        return llama_like_spec(cfg)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: PretrainedConfig,
        dtype: torch.dtype,
        device: torch.device,
        expert_parallel: ExpertParallelSettings | None = None,
    ) -> Self:
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
        hidden: torch.Tensor = self.model(input_ids, positions, batch)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
        return super().ignored_checkpoint_tensor(name) or (self.spec.tie_word_embeddings and name == "lm_head.weight")
