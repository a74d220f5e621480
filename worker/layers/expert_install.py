"""Installing an epoch's expert map on one rank: read the experts it must now hold, rearrange its slots, serve.

Order, so that a failure leaves the rank as it was: first every expert to load is read from the checkpoint into host
memory (a missing file or tensor raises a CheckpointError here, before any slot is touched); then, in every MoE
layer, the experts that change slot are copied through a temporary copy (moves form a permutation of slots, so a
slot may be read after another move has written it), the loaded experts are written into their slots, and finally
the state takes the new map, the epoch's comm and its routing tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.worker.checkpoint.directory import stored_tensors
from tidal.worker.checkpoint.fp8_targets import plan_reads
from tidal.worker.checkpoint.header import dtype_name
from tidal.worker.checkpoint.judge import Expected, tensors_to_read
from tidal.worker.checkpoint.reader import CONVERTIBLE_DTYPES, read_tensors
from tidal.worker.experts.changes import RankChanges
from tidal.worker.experts.expert_map import ExpertMap
from tidal.worker.layers.expert_parallel import EpochRouting, ExpertComm, ExpertParallelState, build_routing
from tidal.worker.layers.moe import SparseMoE


@dataclass(frozen=True)
class ExpertInstallReport:
    loaded_experts: tuple[int, ...]  # logical experts read from the checkpoint into this rank's slots
    bytes_read: int
    seconds: float


@dataclass(frozen=True)
class StagedEpoch:
    """An epoch checked and read into host memory, ready for `apply_epoch` (which only copies on the device)."""

    previous_map: ExpertMap  # the map the changes start from: applying over another one would be wrong
    expert_map: ExpertMap
    changes: RankChanges
    comm: ExpertComm
    routing: EpochRouting
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (view of a slot, its host copy)
    report: ExpertInstallReport


def install_epoch(
    state: ExpertParallelState,
    layers: Sequence[tuple[str, SparseMoE]],
    expert_map: ExpertMap,
    changes: RankChanges,
    comm: ExpertComm,
    checkpoint_dir: Path | None,
) -> ExpertInstallReport:
    """`stage_epoch` then `apply_epoch` at once."""
    staged = stage_epoch(state, layers, expert_map, changes, comm, checkpoint_dir)
    apply_epoch(state, layers, staged)
    return staged.report


def stage_epoch(
    state: ExpertParallelState,
    layers: Sequence[tuple[str, SparseMoE]],
    expert_map: ExpertMap,
    changes: RankChanges,
    comm: ExpertComm,
    checkpoint_dir: Path | None,
) -> StagedEpoch:
    """Check an epoch and read what this rank must load, touching nothing served (so it runs while the previous
    epoch still serves): `layers` are the model's MoE layers by module path, `changes` this rank's
    (`state.changes_to(expert_map)`), `checkpoint_dir` where missing experts are read from (None: nowhere, so an
    epoch that loads any is refused). ValueError for an epoch that does not fit, CheckpointError for a failed read."""
    start = time.monotonic()
    check_epoch(state, expert_map, changes, comm)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    bytes_read = 0
    if changes.loads:
        if checkpoint_dir is None:
            raise ValueError(
                f"experts {list(changes.loaded_experts)} must be loaded and there is no checkpoint to read"
            )
        staged, bytes_read = read_loaded_experts(layers, changes, checkpoint_dir)
    device = layers[0][1].w13.device
    routing = build_routing(expert_map, comm.members, state.rank, device)
    report = ExpertInstallReport(changes.loaded_experts, bytes_read, time.monotonic() - start)
    return StagedEpoch(state.expert_map, expert_map, changes, comm, routing, staged, report)


def apply_epoch(state: ExpertParallelState, layers: Sequence[tuple[str, SparseMoE]], staged: StagedEpoch) -> None:
    """Make this rank serve a staged epoch: moves through a temporary copy, loads into their slots, then the map,
    comm and routing. Between steps only. ValueError (nothing changed) if another epoch was installed since it was
    staged."""
    if state.expert_map is not staged.previous_map:
        raise ValueError("another epoch was installed after this one was staged: stage it again")
    changes = staged.changes
    device = layers[0][1].w13.device
    with torch.no_grad():
        if changes.moves:
            sources = torch.tensor([m.from_slot for m in changes.moves], device=device)
            targets = torch.tensor([m.to_slot for m in changes.moves], device=device)
            for _, layer in layers:
                for stack in layer.stacks():
                    # As bytes: a move copies an expert as it is, and index_copy_ has no e4m3 kernel.
                    raw = stack.data.view(torch.uint8)
                    raw.index_copy_(0, targets, raw.index_select(0, sources))  # a copy of every source first
        for slot_view, host in staged.staged:
            slot_view.copy_(host)
    state.enter_epoch(staged.expert_map, staged.comm, staged.routing)


def check_epoch(state: ExpertParallelState, expert_map: ExpertMap, changes: RankChanges, comm: ExpertComm) -> None:
    """ValueError unless the map is for this model's experts and slots (over the map's group size, the epoch's) with
    exactly the comm's members, this rank is one of them at its place, and `changes` are what takes this rank's
    slots to the map's."""
    expert_map.check_fits(state.shape_for(expert_map.group_size), list(comm.members))
    members = list(comm.members)
    if comm.size != len(members) or not 0 <= comm.group_rank < len(members) or members[comm.group_rank] != state.rank:
        raise ValueError(
            f"rank {state.rank} is not group index {comm.group_rank} of the epoch's members {members} "
            f"(size {comm.size})"
        )
    expected = state.changes_to(expert_map)
    if changes != expected:
        raise ValueError(
            f"rank {state.rank}: the changes given ({changes}) do not take its slots {list(state.slots)} to the "
            f"map's {list(expert_map.rank_slots(state.rank))} (that takes {expected})"
        )


def read_loaded_experts(
    layers: Sequence[tuple[str, SparseMoE]], changes: RankChanges, checkpoint_dir: Path
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Every tensor of every expert `changes` loads, read into host memory -> ([(view of its slot, host copy)],
    bytes read). Nothing is read when nothing is loaded."""
    host: dict[str, torch.Tensor] = {}  # checkpoint name -> host buffer
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for path, layer in layers:
        block = layer.checkpoint_block(path)
        for load in changes.loads:
            for name, view in layer.expert_tensors(block, load.slot, load.expert).items():
                host[name] = torch.empty(view.shape, dtype=view.dtype)
                staged.append((view, host[name]))
    if not host:
        return [], 0
    expected = {name: Expected(tuple(t.shape), CONVERTIBLE_DTYPES | {dtype_name(t.dtype)}) for name, t in host.items()}
    stored = stored_tensors(checkpoint_dir)
    # FP8 experts from a 16-bit checkpoint: each weight is quantized into its host buffer and scale as it is read.
    expected, destinations = plan_reads(expected, host, stored)
    tensors = tensors_to_read(stored, expected, allow_extra=True, wanted=expected.keys())
    return staged, read_tensors(tensors, destinations).num_bytes
