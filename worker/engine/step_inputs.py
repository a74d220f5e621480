"""A step plan's integer inputs on the device: one pinned host buffer, one copy, then views (the eager forward and
both kinds of CUDA graphs take them from here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.step_plan import StepPlan, padded_block_tables


@dataclass(frozen=True)
class StepInputs:
    """Views of one int64 device tensor."""

    input_ids: torch.Tensor  # [T], UNKNOWN_TOKEN at unknown_rows until `fill_unknown_inputs`
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    cu_seqlens_q: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, width], each row padded with block 0 (never read)
    unknown_rows: torch.Tensor  # [U]
    unknown_sources: torch.Tensor  # [U]


def step_inputs(plan: StepPlan, width: int, device: torch.device) -> StepInputs:
    """`plan`'s inputs on `device`, block tables `width` wide (at least the longest)."""
    num_tokens, num_seqs, num_unknown = plan.num_tokens, plan.num_seqs, len(plan.unknown_rows)
    # Every int input in one host tensor and (on a GPU) one copy, instead of a tensor and a copy each.
    flat = plan.input_ids + plan.positions + plan.slot_mapping + plan.cu_seqlens_q + plan.seq_lens
    flat += padded_block_tables(plan.block_tables, width)
    flat += plan.unknown_rows + plan.unknown_sources
    packed = to_device(int64_tensor(flat), device)  # [3T + 2B + 1 + B * width + 2U]
    input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, tables, unknown_rows, unknown_sources = packed.split(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_unknown, num_unknown]
    )
    return StepInputs(
        input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, tables.view(num_seqs, width), unknown_rows,
        unknown_sources,
    )  # fmt: skip


def fill_unknown_inputs(input_ids: torch.Tensor, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> None:
    """input_ids[unknown_rows] = previous_tokens[unknown_sources] (async scheduling: what the previous step samples,
    still on the device), a gather queued behind that step's sampling; nothing when no input is unknown."""
    if inputs.unknown_rows.shape[0] == 0:
        return
    if previous_tokens is None:
        raise ValueError("the plan takes input tokens from the previous step's, and none were given")
    input_ids.index_copy_(0, inputs.unknown_rows, previous_tokens.index_select(0, inputs.unknown_sources))


def copy_token_inputs(
    inputs: StepInputs,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    previous_tokens: torch.Tensor | None,
) -> None:
    """A graph's static token inputs (their first T rows) from `inputs`, the unknown ones gathered after; outside
    the graph, before its replay."""
    num_tokens = inputs.input_ids.shape[0]
    input_ids[:num_tokens].copy_(inputs.input_ids)
    fill_unknown_inputs(input_ids, inputs, previous_tokens)
    positions[:num_tokens].copy_(inputs.positions)
    slot_mapping[:num_tokens].copy_(inputs.slot_mapping)
