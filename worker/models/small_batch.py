"""The decoder's forward for a few rows (decode at batch <= 16 on a GPU): six launches per layer instead of twelve.

Each projection is one `tidal.kernels.small_batch_linear` kernel whose epilogue does the op that follows it, so
neither RMSNorm nor SiLU-and-mul nor cuBLAS's split-K reduce is a launch of its own:

    q        <- linear_rows(h * gamma_in, scaled by 1/rms) for q, k, v; rotary on q and k, k and v into the
                KV cache (small_batch_qkv; Qwen3's per-head q/k norm keeps the separate rotary+store kernel)
    attention (unchanged: decode split + merge)
    h        <- h + o_proj(attention)    also writes h * gamma_post and partial sums of h^2
    act      <- silu(gate) * up of linear_rows(h * gamma_post, scaled by 1/rms)
    h        <- h + down_proj(act)       also writes h * gamma_in of the next layer, and its partial sums

The weights are the same tensors the unfused layers use: weight updates, sleep and checksums see no difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tidal.kernels.rms_norm import rms_norm
from tidal.kernels.small_batch_linear import (
    NormInput,
    linear_rows_into_residual_triton,
    linear_rows_triton,
    norm_input_reference,
)
from tidal.kernels.small_batch_qkv import can_fuse_rotary, qkv_rope_store_triton
from tidal.worker.layers.attention import AttentionBatch

if TYPE_CHECKING:
    from tidal.worker.models.decoder import DecoderAttention, DecoderLayer, DecoderModel


def _rotary_fuses(attn: DecoderAttention) -> bool:
    rotary = attn.rotary_emb
    return can_fuse_rotary(attn.head_dim, rotary.cos_sin_cache.shape[1], rotary.is_neox, attn.q_norm is not None)


def small_batch_forward(
    model: DecoderModel, hidden: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """hidden [T, H] (the embeddings, T <= 16) -> the final normed hidden states [T, H]."""
    layers = list(model.layers)
    # Entering the first layer: a few tiny torch ops once per step.
    norm_in = norm_input_reference(hidden, layers[0].input_layernorm.weight)
    residual = hidden
    for i, layer in enumerate(layers):
        # The last layer's epilogue prepares the final norm's input; its unfused kernel normalises below instead,
        # rounding exactly as every other path does before the LM head.
        next_gamma = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.norm.weight
        residual, norm_in = _layer(layer, positions, residual, norm_in, next_gamma, batch)
    return rms_norm(residual, model.norm.weight, model.norm.eps)  # type: ignore[return-value]


def _layer(
    layer: DecoderLayer,
    positions: torch.Tensor,
    residual: torch.Tensor,
    norm_in: NormInput,
    next_gamma: torch.Tensor,
    batch: AttentionBatch,
) -> tuple[torch.Tensor, NormInput]:
    attn, mlp = layer.self_attn, layer.mlp
    eps = layer.input_layernorm.eps
    if _rotary_fuses(attn):
        k_cache, v_cache = attn.attn.kv_cache(batch)
        q = qkv_rope_store_triton(
            norm_in.scaled, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_in.partial_sq, eps, positions,
            attn.rotary_emb.cos_sin_cache, k_cache, v_cache, batch.slot_mapping, attn.num_heads, attn.num_kv_heads,
        )  # fmt: skip
        out = attn.attn.attend(q, batch).reshape(q.shape[0], attn.q_size)  # [T, q_size]
    else:
        qkv = linear_rows_triton(norm_in.scaled, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_in.partial_sq, eps)
        out = attn.attend_qkv(positions, qkv, batch)  # [T, q_size]
    residual, norm_in = linear_rows_into_residual_triton(
        out, attn.o_proj.weight, residual, layer.post_attention_layernorm.weight, attn.o_proj.bias
    )
    eps = layer.post_attention_layernorm.eps
    act = linear_rows_triton(
        norm_in.scaled, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_in.partial_sq, eps, gated=True
    )
    return linear_rows_into_residual_triton(act, mlp.down_proj.weight, residual, next_gamma, mlp.down_proj.bias)
