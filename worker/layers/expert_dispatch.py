"""Dispatch and combine for an expert-parallel MoE layer: every (token, chosen expert) row goes to the rank holding
the copy routing picks, that rank runs its slot's expert on it, and the result comes back to be weighted and summed.

One step of one layer is three collectives: the row counts, the rows out (each row's slot index and hidden state
packed into one byte row, so one exchange carries both), and the expert outputs back. The routing weights never
leave their rank: the source weights what comes back, accumulating in fp32 like the single-process kernel.
A rank with no tokens (an empty step) sends nothing but still serves the rows its peers send it. The first two are
the dispatch phase and the last the combine phase of `ExchangeStats` (bytes counted, time when asked for).
"""

from __future__ import annotations

import contextlib

import torch

from tidal.kernels.fused_moe import fused_moe_experts_reference, fused_moe_experts_triton
from tidal.kernels.moe_expert_scales import ExpertScales
from tidal.worker.layers.expert_exchange import ExchangeStats
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
    stats: ExchangeStats | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """hidden [T, H], topk_weights [T, k] fp32 and topk_ids [T, k] (logical experts) -> [T, H] in hidden's dtype:
    sum over k of weight * expert(hidden), the experts run by the ranks holding them; w13 [S, 2I, H], w2 [S, H, I]
    are this rank's slots (`scales` theirs when they are FP8). `stats`: where the exchanges are counted (and timed),
    for a group of more than one."""
    num_tokens, top_k = topk_ids.shape
    num_slots = routing.slots_per_rank
    ids = topk_ids.long()
    turn = torch.arange(num_tokens, device=ids.device).unsqueeze(1) % routing.num_copies[ids]  # [T, k]
    target = routing.copy_table[ids, turn].view(-1)  # [T * k]: group_index * S + slot
    dest = target // num_slots
    order = torch.argsort(dest, stable=True)  # [T * k] rows grouped by destination, in member order
    send_counts = torch.bincount(dest, minlength=comm.size)  # [size]
    tokens = order // top_k  # [T * k] the token of each sorted row
    slots = (target[order] % num_slots).to(torch.int32)  # [T * k]
    packed = pack_rows(hidden.index_select(0, tokens), slots)  # [T * k, 4 + H * b]
    if comm.size == 1:
        stats = None  # a rank alone (the warm-up's loopback) exchanges nothing with anyone
    with _timing(stats, "dispatch", hidden.device):
        recv_counts = comm.all_to_all_counts(send_counts)  # [size]
        sends, recvs = send_counts.tolist(), recv_counts.tolist()  # the host needs the splits (a sync on a GPU)
        rows = comm.all_to_all(packed, sends, recvs)  # [M, 4 + H * b]
    received, received_slots = unpack_rows(rows, hidden.dtype, hidden.shape[1])  # [M, H], [M, 1]
    ones = torch.ones(received_slots.shape, dtype=torch.float32, device=hidden.device)  # [M, 1]
    if hidden.is_cuda:
        # The received row count changes every step (the host learns it above, so no graph holds this); the grouped
        # GEMMs do not specialise on it, and staying on them means a step never compiles the small-batch kernels
        # for the first time while its peers wait on it.
        expert_out = fused_moe_experts_triton(
            received, w13, w2, ones, received_slots, allow_small_batch=False, scales=scales
        )
    else:
        expert_out = fused_moe_experts_reference(received, w13, w2, ones, received_slots, scales)  # [M, H]
    with _timing(stats, "combine", hidden.device):
        returned = comm.all_to_all(expert_out, recvs, sends)  # [T * k, H], in `order`
    if stats is not None:
        me = comm.group_rank
        rows_out, rows_in = sum(sends) - sends[me], sum(recvs) - recvs[me]  # rows that cross a link
        stats.add("dispatch", rows_out * packed.shape[1], rows_in * packed.shape[1])
        out_row_bytes = expert_out.shape[1] * expert_out.element_size()
        stats.add("combine", rows_in * out_row_bytes, rows_out * out_row_bytes)
    weights = topk_weights.reshape(-1)[order].float()  # [T * k]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    out.index_add_(0, tokens, returned.float() * weights[:, None])
    return out.to(hidden.dtype)


def _timing(stats: ExchangeStats | None, phase: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    return stats.timing(phase, device) if stats is not None else contextlib.nullcontext()


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
