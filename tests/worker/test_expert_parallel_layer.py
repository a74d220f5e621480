"""The expert-parallel MoE layer: routing tensors that follow the routing rule, checkpoint names that follow the
slots, and, over 2 and 4 real processes (gloo), each rank's output on its own tokens (one rank with none) equal to
the single-process layer's on the same tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.fused_moe import topk_route_reference
from tidal.worker.experts.expert_map import ExpertMap, GroupShape
from tidal.worker.experts.full_layout import full_layout
from tidal.worker.experts.placement import plan_placement
from tidal.worker.experts.routing import pick_copy
from tidal.worker.layers.expert_dispatch import pack_rows, unpack_rows
from tidal.worker.layers.expert_parallel import (
    ExpertGroupMissingError,
    ExpertParallelSettings,
    ExpertParallelState,
    build_routing,
)
from tidal.worker.layers.moe import MoeSpec, SparseMoE
from tidal.worker.models.mixtral import MIXTRAL_EXPERT_NAMES
from tidal.worker.models.qwen_moe import QWEN_MOE_EXPERT_NAMES
from tidal.worker.testing.expert_parallel_peers import GlooExpertComm, run_peers

CPU = torch.device("cpu")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2
# (checkpoint names, renormalize, shared expert size): Mixtral, Qwen2-MoE, Qwen3-MoE's shapes of the block.
LAYER_KINDS = [(MIXTRAL_EXPERT_NAMES, True, 0), (QWEN_MOE_EXPERT_NAMES, False, 12), (QWEN_MOE_EXPERT_NAMES, True, 0)]
TOKENS_PER_RANK = {2: [6, 0], 4: [5, 0, 9, 3]}  # different tokens on every rank, and one rank with none


def spec(kind: int) -> MoeSpec:
    names, renormalize, shared = LAYER_KINDS[kind]
    return MoeSpec(EXPERTS, TOP_K, INTER, renormalize, names, shared_expert_intermediate_size=shared)


def full_layer(kind: int) -> SparseMoE:
    layer = SparseMoE(HIDDEN, spec(kind), torch.float32, CPU)
    gen = torch.Generator().manual_seed(kind)
    for tensor in layer.parameters():
        tensor.data.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)
    return layer


def rank_layer(full: SparseMoE, state: ExpertParallelState) -> SparseMoE:
    """The layer of one rank: `full`'s router and shared expert, and the experts its slots hold."""
    layer = SparseMoE(HIDDEN, full.moe, torch.float32, CPU, state)
    theirs = dict(full.named_parameters())
    for name, param in layer.named_parameters():
        if name not in ("w13", "w2"):
            param.data.copy_(theirs[name])
    for slot, expert in enumerate(state.slots):
        if expert is not None:
            layer.w13.data[slot] = full.w13.data[expert]
            layer.w2.data[slot] = full.w2.data[expert]
    return layer


def tokens(rank: int, count: int) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))


def layer_scenario(rank: int, world_size: int) -> list[float]:
    """Every layer kind with R = 0 and 1: this rank's tokens through the expert-parallel layer and the full one."""
    comm = GlooExpertComm(range(world_size))
    differences = []
    for kind in range(len(LAYER_KINDS)):
        full = full_layer(kind)
        for redundant in (0, 1):
            state = ExpertParallelState(ExpertParallelSettings(rank, world_size, redundant), EXPERTS)
            layer = rank_layer(full, state)
            state.enter_epoch(state.expert_map, comm, build_routing(state.expert_map, comm.members, rank, CPU))
            x = tokens(rank, TOKENS_PER_RANK[world_size][rank])
            with torch.no_grad():
                out, expected = layer(x), full(x)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            differences.append(float((out - expected).abs().max()) if out.numel() else 0.0)
    return differences


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_gets_the_single_process_output_for_its_own_tokens(world_size):
    results = run_peers(world_size, layer_scenario)
    assert len(results) == world_size and all(len(r) == 2 * len(LAYER_KINDS) for r in results)


def exchange_scenario(rank: int, world_size: int) -> dict[str, object]:
    """Two steps of one layer (R = 1) with rank 0 timing its exchanges -> this rank's exchange totals and the rows
    the routing rule sends away from it in one step, counted here without the layer."""
    comm = GlooExpertComm(range(world_size))
    full = full_layer(0)
    settings = ExpertParallelSettings(rank, world_size, 1, time_exchanges=rank == 0)
    state = ExpertParallelState(settings, EXPERTS)
    layer = rank_layer(full, state)
    state.enter_epoch(state.expert_map, comm, build_routing(state.expert_map, comm.members, rank, CPU))
    x = tokens(rank, TOKENS_PER_RANK[world_size][rank])
    with torch.no_grad():
        layer(x)
        layer(x)
        _, ids = topk_route_reference(F.linear(x, full.router), TOP_K, full.moe.renormalize)
    away = sum(
        pick_copy(state.expert_map.copies(expert), token, rank).rank != rank
        for token, row in enumerate(ids.tolist())
        for expert in row
    )
    return {"totals": [dataclasses.asdict(t) for t in state.exchange.snapshot().phases], "away": away}


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchanges_count_the_bytes_that_cross_links_and_time_only_when_asked(world_size):
    results = run_peers(world_size, exchange_scenario)
    row_out, row_back = 4 + HIDDEN * 4, HIDDEN * 4  # fp32: the slot index and the hidden state; the output
    by_phase: dict[str, list[dict]] = {"dispatch": [], "combine": []}
    for rank, result in enumerate(results):
        dispatch, combine = result["totals"]
        assert (dispatch["phase"], combine["phase"]) == ("dispatch", "combine")
        assert dispatch["exchanges"] == combine["exchanges"] == 2  # two steps of one layer
        assert dispatch["bytes_sent"] == 2 * result["away"] * row_out
        assert combine["bytes_received"] == 2 * result["away"] * row_back
        assert combine["bytes_sent"] * row_out == dispatch["bytes_received"] * row_back  # each row comes back
        timed = rank == 0
        for phase in (dispatch, combine):
            assert (phase["seconds"] is not None) == timed
            assert not timed or phase["seconds"] > 0
            by_phase[phase["phase"]].append(phase)
    assert any(r["away"] for r in results)  # the test sends something over the wire
    for phase in by_phase.values():  # what one rank sends, another receives
        assert sum(p["bytes_sent"] for p in phase) == sum(p["bytes_received"] for p in phase)


@pytest.mark.parametrize(("world_size", "redundant", "absent"), [(4, 1, ()), (4, 1, (2,)), (2, 0, ()), (3, 2, ())])
def test_routing_tensors_pick_the_copy_the_routing_rule_picks(world_size, redundant, absent):
    shape = GroupShape.even_share(EXPERTS, world_size, redundant)
    full = plan_placement(shape, range(world_size)).expert_map
    present = [r for r in range(world_size) if r not in absent]
    expert_map = plan_placement(shape, present, previous=full).expert_map
    for me in present:
        routing = build_routing(expert_map, present, me, CPU)
        for expert in range(EXPERTS):
            for token in range(7):
                flat = int(routing.copy_table[expert, token % int(routing.num_copies[expert])])
                group_index, slot = divmod(flat, shape.slots_per_rank)
                picked = pick_copy(expert_map.copies(expert), token, me)
                assert (present[group_index], slot) == (picked.rank, picked.slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatched_rows_carry_the_slot_and_the_hidden_state_exactly(dtype):
    hidden = torch.randn(5, HIDDEN).to(dtype)
    slots = torch.tensor([0, 3, 2, 7, 1], dtype=torch.int32)
    back, back_slots = unpack_rows(pack_rows(hidden, slots), dtype, HIDDEN)
    assert torch.equal(back, hidden) and back_slots.view(-1).tolist() == slots.tolist()


def test_checkpoint_names_follow_the_slots():
    state = ExpertParallelState(ExpertParallelSettings(1, 4, 1), EXPERTS)
    layer = rank_layer(full_layer(0), state)
    tensors = layer.checkpoint_tensors("model.layers.3.mlp")
    held = [e for e in state.slots if e is not None]
    assert len(held) == state.slots_per_rank == 3
    block = "model.layers.3.block_sparse_moe"
    assert set(tensors) == {f"{block}.gate.weight"} | {
        f"{block}.experts.{e}.{p}.weight" for e in held for p in ("w1", "w3", "w2")
    }
    for slot, expert in enumerate(state.slots):
        assert tensors[f"{block}.experts.{expert}.w2.weight"].data_ptr() == layer.w2[slot].data_ptr()
    # Another map gives the slots other experts: the names follow.
    state.expert_map = ExpertMap(EXPERTS, 4, 3, ((1, 2, 3), (7, 0, None), (4, 5, 6), None))
    names = set(layer.checkpoint_tensors("model.layers.3.mlp"))
    assert {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n} == {"7", "0"}
    assert layer.expert_of(block, f"{block}.experts.5.w1.weight") == 5
    assert layer.expert_of(block, f"{block}.experts.5.bias") is None
    assert layer.expert_of(block, f"{block}.gate.weight") is None


def test_a_layer_without_an_epoch_refuses_to_run():
    state = ExpertParallelState(ExpertParallelSettings(0, 2, 0), EXPERTS)
    layer = rank_layer(full_layer(0), state)
    with pytest.raises(ExpertGroupMissingError, match="no expert-parallel epoch"):
        layer(tokens(0, 3))


def test_more_slots_than_experts_is_refused():
    with pytest.raises(ValueError, match="lower redundant_experts_per_rank"):
        ExpertParallelState(ExpertParallelSettings(0, 2, 5), EXPERTS)


def test_a_slot_count_given_outright_wins_and_must_hold_every_expert_over_the_start_group():
    # A rank joining a group of 3 that grew to 4 keeps the running count, ceil(8 / 3) + 1 = 4, not ceil(8 / 4) + 1.
    state = ExpertParallelState(ExpertParallelSettings(3, 4, 1, slots_per_rank=4), EXPERTS)
    assert state.slots_per_rank == 4 and state.shape == GroupShape(EXPERTS, 4, 4)
    assert state.shape_for(3) == GroupShape(EXPERTS, 3, 4)
    assert state.expert_map == full_layout(GroupShape(EXPERTS, 4, 4))
    with pytest.raises(ValueError, match=r"4 x 1 = 4 expert slots for 8 experts"):
        ExpertParallelState(ExpertParallelSettings(0, 4, 0, slots_per_rank=1), EXPERTS)
