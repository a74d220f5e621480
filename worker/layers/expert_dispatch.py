"""Dispatch and combine for an expert-parallel MoE layer: every (token, chosen expert) row goes to the rank holding
the copy routing picks, that rank runs its slot's expert on it, and the result comes back to be weighted and summed.

One step of one layer is three collectives: the row counts, the rows out (each row's slot index and hidden state
packed into one byte row, so one exchange carries both), and the expert outputs back. The routing weights never
leave their rank: the source weights what comes back, accumulating in fp32 like the single-process kernel.
A rank with no tokens (an empty step) sends nothing but still serves the rows its peers send it.
"""

from __future__ import annotations

import torch

from tidal.kernels.fused_moe import fused_moe_experts_reference, fused_moe_experts_triton
from tidal.worker.layers.expert_parallel import EpochRouting, ExpertComm

SLOT_BYTES = 4  # an int32 slot index at the front of each dispatched row


def dispatch_and_combine(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    comm: ExpertComm,
    routing: EpochRouting,
) -> torch.Tensor:
    """hidden [T, H], topk_weights [T, k] fp32 and topk_ids [T, k] (logical experts) -> [T, H] in hidden's dtype:
    sum over k of weight * expert(hidden), the experts run by the ranks holding them; w13 [S, 2I, H], w2 [S, H, I]
    are this rank's slots."""
    num_tokens, top_k = topk_ids.shape
    num_slots = routing.slots_per_rank
    ids = topk_ids.long()
    turn = torch.arange(num_tokens, device=ids.device).unsqueeze(1) % routing.num_copies[ids]  # [T, k]
    target = routing.copy_table[ids, turn].view(-1)  # [T * k]: group_index * S + slot
    dest = target // num_slots
    order = torch.argsort(dest, stable=True)  # [T * k] rows grouped by destination, in member order
    send_counts = torch.bincount(dest, minlength=comm.size)  # [size]
    recv_counts = comm.all_to_all_counts(send_counts)  # [size]
    sends, recvs = send_counts.tolist(), recv_counts.tolist()  # the host needs the splits (a sync on a GPU)
    tokens = order // top_k  # [T * k] the token of each sorted row
    slots = (target[order] % num_slots).to(torch.int32)  # [T * k]
    rows = comm.all_to_all(pack_rows(hidden.index_select(0, tokens), slots), sends, recvs)  # [M, 4 + H * b]
    received, received_slots = unpack_rows(rows, hidden.dtype, hidden.shape[1])  # [M, H], [M, 1]
    ones = torch.ones(received_slots.shape, dtype=torch.float32, device=hidden.device)  # [M, 1]
    if hidden.is_cuda:
        # The received row count changes every step (the host learns it above, so no graph holds this); the grouped
        # GEMMs do not specialise on it, and staying on them means a step never compiles the small-batch kernels
        # for the first time while its peers wait on it.
        expert_out = fused_moe_experts_triton(received, w13, w2, ones, received_slots, allow_small_batch=False)
    else:
        expert_out = fused_moe_experts_reference(received, w13, w2, ones, received_slots)  # [M, H]
    returned = comm.all_to_all(expert_out, recvs, sends)  # [T * k, H], in `order`
    weights = topk_weights.reshape(-1)[order].float()  # [T * k]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    out.index_add_(0, tokens, returned.float() * weights[:, None])
    return out.to(hidden.dtype)


def pack_rows(hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """hidden [N, H], slots [N] int32 -> [N, 4 + H * itemsize] uint8: the slot's bytes, then the hidden state's."""
    return torch.cat([slots.view(-1, 1).view(torch.uint8), hidden.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_rows` -> (hidden [N, H] of `dtype`, slots [N, 1] int32), both contiguous."""
    slots = rows[:, :SLOT_BYTES].contiguous().view(torch.int32)  # [N, 1]
    hidden = rows[:, SLOT_BYTES:].contiguous().view(dtype)  # [N, H]
    if hidden.shape[1] != hidden_size:
        raise ValueError(f"dispatched rows carry {hidden.shape[1]} values, the layer's hidden size is {hidden_size}")
    return hidden, slots
