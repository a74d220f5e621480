"""The MoE families with expert parallelism: start-up reads only this rank's experts, installing an epoch loads what
it must (and a failed read changes nothing), and over 2 and 4 real processes (gloo) every rank's hidden states for
its own prompt (one rank with none, running empty steps) equal the single-process model's: in the full layout, and
with 4 ranks also with rank 3 absent (its experts reloaded by the survivors) and back in the full layout."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.worker.checkpoint.errors import CheckpointFilesMissingError
from tidal.worker.experts.expert_map import ExpertMap
from tidal.worker.experts.placement import plan_placement
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.layers.expert_parallel import ExpertParallelSettings
from tidal.worker.loader.model_loader import load_model
from tidal.worker.models.base import CausalLM
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM
from tidal.worker.testing.expert_parallel_peers import GlooExpertComm, run_peers

CPU = torch.device("cpu")
ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
PROMPT_LENGTHS = [7, 0, 11, 4]  # by rank: rank 1 has no tokens and runs empty steps
BLOCK_SIZE = 16


@dataclass(frozen=True)
class CommWithoutPeers:
    """An epoch's membership for installs, which exchange nothing; any collective is a test failure."""

    members: tuple[int, ...]
    group_rank: int

    @property
    def size(self) -> int:
        return len(self.members)

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        raise AssertionError("an install must not communicate")

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        raise AssertionError("an install must not communicate")


def ep_model(
    model_dir: Path, rank: int, world_size: int, redundant: int, weight_dtype: str = "auto"
) -> MoeDecoderForCausalLM:
    settings = ExpertParallelSettings(rank, world_size, redundant)
    model = load_model(model_dir, "float32", CPU, expert_parallel=settings, weight_dtype=weight_dtype)
    assert isinstance(model.model, MoeDecoderForCausalLM) and model.model.expert_parallel is not None
    return model.model


def hidden_states(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """The final hidden states [len, H] of a prefill of all tokens but the last, then a decode step of the last."""
    spec = model.kv_cache_spec
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    block_shape = (num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(block_shape), torch.zeros(block_shape)) for _ in range(spec.num_layers)]
    tables = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    outputs = []
    for begin, end in ((0, len(token_ids) - 1), (len(token_ids) - 1, len(token_ids))):
        batch = AttentionBatch(
            slot_mapping=torch.arange(begin, end),
            block_tables=tables,
            cu_seqlens_q=torch.tensor([0, end - begin], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            is_decode_only=end - begin == 1,
            kv_caches=caches,
        )
        with torch.no_grad():
            outputs.append(model(torch.tensor(token_ids[begin:end]), torch.arange(begin, end), batch))
    return torch.cat(outputs)


def check_rank_outputs(model: MoeDecoderForCausalLM, reference: CausalLM, rank: int) -> None:
    length = PROMPT_LENGTHS[rank]
    if length == 0:
        for _ in range(2):  # the prefill and the decode step its peers run
            with torch.no_grad():
                model.run_empty_moe_step()
        return
    token_ids = torch.randint(0, model.vocab_size, (length,), generator=torch.Generator().manual_seed(rank)).tolist()
    expected = hidden_states(reference, token_ids)
    torch.testing.assert_close(hidden_states(model, token_ids), expected, rtol=1e-4, atol=1e-4)


def group_scenario(rank: int, world_size: int, model_dirs: dict[str, str]) -> dict[str, list[int]]:
    """Per arch: R = 0 and 1 in the full layout; with R = 1 and 4 ranks also rank 3 absent, then the full layout
    again. -> what the degraded epoch loaded on this rank, and what its plan said was missing."""
    everyone = GlooExpertComm(range(world_size))
    survivors = [0, 1, 2] if world_size == 4 else []
    survivors_group = dist.new_group(survivors) if survivors else None  # every rank takes part in making it
    found: dict[str, list[int]] = {}
    for arch, path in model_dirs.items():
        model_dir = Path(path)
        reference = load_model(model_dir, "float32", CPU).model
        for redundant in (0, 1):
            model = ep_model(model_dir, rank, world_size, redundant)
            state = model.expert_parallel
            assert state is not None
            first = model.install_expert_epoch(
                state.expert_map, state.changes_to(state.expert_map), everyone, model_dir
            )
            assert first.loaded_experts == () and first.bytes_read == 0
            check_rank_outputs(model, reference, rank)
        if rank in survivors:
            plan = plan_placement(state.shape, survivors, previous=state.expert_map)
            comm = GlooExpertComm(survivors, survivors_group)
            degraded = model.install_expert_epoch(plan.expert_map, state.changes_to(plan.expert_map), comm, model_dir)
            found[f"{arch}/degraded"] = list(degraded.loaded_experts)
            found[f"{arch}/missing"] = list(plan.missing_experts)
            check_rank_outputs(model, reference, rank)
        whole = plan_placement(state.shape, range(world_size), previous=state.expert_map).expert_map
        model.install_expert_epoch(whole, state.changes_to(whole), everyone, model_dir)
        check_rank_outputs(model, reference, rank)
    return found


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_serves_its_own_prompt_as_one_process_would(world_size, tiny_model):
    model_dirs = {arch: str(tiny_model(arch)) for arch in ARCHS}
    results = run_peers(world_size, group_scenario, (model_dirs,), timeout_s=300)
    if world_size == 2:
        return
    for arch in ARCHS:
        missing = results[0][f"{arch}/missing"]
        loaded = sorted(e for r in results[:3] for e in r[f"{arch}/degraded"])
        assert missing and loaded == sorted(missing), arch  # each missing expert loaded once, by one survivor


def fp8_scenario(rank: int, world_size: int, model_dir: str) -> None:
    """FP8 experts spread over the group: each rank's output equals the single-process FP8 model's (the scales
    travel with the slots, and the ranks that run a dispatched row scale it as one process would)."""
    reference = load_model(Path(model_dir), "float32", CPU, weight_dtype="fp8").model
    model = ep_model(Path(model_dir), rank, world_size, 1, "fp8")
    state = model.expert_parallel
    assert state is not None
    model.install_expert_epoch(state.expert_map, state.changes_to(state.expert_map), GlooExpertComm(range(world_size)),
                               Path(model_dir))  # fmt: skip
    check_rank_outputs(model, reference, rank)


def test_fp8_experts_serve_over_the_group_as_one_process_would(tiny_model):
    run_peers(2, fp8_scenario, (str(tiny_model("qwen3_moe")),), timeout_s=300)


def served_from(on_disk: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `weights` (a model's served tensors) should hold after reading `on_disk`: FP8 weights and their scales
    quantized from the stored rows, everything else as stored."""
    want = {}
    for name, tensor in weights.items():
        if name.endswith("_scale"):
            want[name] = quantize_rows_reference(on_disk[name.removesuffix("_scale")])[1]
        elif tensor.dtype == FP8_E4M3:
            want[name] = quantize_rows_reference(on_disk[name])[0]
        else:
            want[name] = on_disk[name]
    return want


def assert_served(weights: dict[str, torch.Tensor], on_disk: dict[str, torch.Tensor]) -> None:
    want = served_from(on_disk, weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor.view(torch.uint8), want[name].view(torch.uint8)), name


# ----- one process: what is read, named and ignored -----


def test_start_up_reads_only_the_experts_this_rank_holds(tiny_model):
    model_dir = tiny_model("mixtral")
    loaded = load_model(model_dir, "float32", CPU, expert_parallel=ExpertParallelSettings(2, 4, 1))
    model = loaded.model
    assert isinstance(model, MoeDecoderForCausalLM) and model.expert_parallel is not None
    held = model.expert_parallel.held_experts
    weights = model.checkpoint_weights()
    on_disk = load_file(model_dir / "model.safetensors")
    experts_named = {int(n.split(".experts.")[1].split(".")[0]) for n in weights if ".experts." in n}
    assert experts_named == held and len(held) == 3
    assert loaded.report.num_tensors == len(weights) < len(on_disk)
    for name, tensor in weights.items():
        assert torch.equal(tensor, on_disk[name]), name
    for name in on_disk:
        expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
        assert model.ignored_checkpoint_tensor(name) == (expert is not None and int(expert) not in held), name


@pytest.mark.parametrize(
    ("arch", "settings"),
    [
        ("qwen2_moe", ExpertParallelSettings(0, 1, 0)),
        ("llama", ExpertParallelSettings(0, 1, 0)),
        ("llama", ExpertParallelSettings(1, 4, 1)),  # a dense model runs whole on every rank of a group
    ],
)
def test_world_size_one_or_a_dense_model_builds_the_model_of_before(arch, settings, tiny_model):
    model_dir = tiny_model(arch)
    plain = load_model(model_dir, "float32", CPU).model
    model = load_model(model_dir, "float32", CPU, expert_parallel=settings).model
    assert model.expert_parallel is None
    shapes = {name: t.shape for name, t in model.checkpoint_weights().items()}
    assert shapes == {name: t.shape for name, t in plain.checkpoint_weights().items()}


def degraded_install(model_dir: Path, weight_dtype: str = "auto") -> tuple[MoeDecoderForCausalLM, int]:
    """A model of the rank of 4 (R = 1) that loads the most when rank 3 is gone, and that rank."""
    probe = ep_model(model_dir, 0, 4, 1).expert_parallel
    assert probe is not None
    plan = plan_placement(probe.shape, [0, 1, 2], previous=probe.expert_map)
    rank = max((0, 1, 2), key=lambda r: len(plan.changes_of(r).loads))
    return ep_model(model_dir, rank, 4, 1, weight_dtype), rank


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])
def test_a_degraded_epoch_loads_the_missing_experts_and_the_names_follow(tiny_model, weight_dtype):
    model_dir = tiny_model("qwen3_moe")
    model, rank = degraded_install(model_dir, weight_dtype)
    state = model.expert_parallel
    assert state is not None
    plan = plan_placement(state.shape, [0, 1, 2], previous=state.expert_map)
    changes = state.changes_to(plan.expert_map)
    assert changes.loads
    report = model.install_expert_epoch(plan.expert_map, changes, CommWithoutPeers((0, 1, 2), rank), model_dir)
    assert report.loaded_experts == changes.loaded_experts and report.bytes_read > 0
    assert state.slots == plan.expert_map.rank_slots(rank)
    on_disk = load_file(model_dir / "model.safetensors")
    weights = model.checkpoint_weights()
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in weights if ".experts." in n} == state.held_experts
    assert_served(weights, on_disk)
    # The sparse layers' slots hold exactly the map's experts (the dense layer 2 has none).
    for path, layer in model.expert_layers:
        block = layer.checkpoint_block(path)
        for slot, expert in enumerate(state.slots):
            name = f"{block}.experts.{expert}.down_proj.weight"
            want = served_from(on_disk, {name: layer.w2[slot]})[name]
            assert torch.equal(layer.w2[slot].view(torch.uint8), want.view(torch.uint8))
            if layer.w2_scale is not None:
                assert torch.equal(layer.w2_scale[slot], quantize_rows_reference(on_disk[name])[1])


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])
def test_experts_that_change_slot_are_moved_without_a_read(tiny_model, tmp_path, weight_dtype):
    model_dir = tiny_model("qwen2_moe")
    model = ep_model(model_dir, 1, 4, 1, weight_dtype)
    state = model.expert_parallel
    assert state is not None
    rows = list(state.expert_map.slots)
    rows[1] = rows[1][1:] + rows[1][:1]  # this rank's experts each one slot over: a cycle of moves
    rotated = ExpertMap(state.expert_map.num_experts, 4, state.slots_per_rank, tuple(rows))
    changes = state.changes_to(rotated)
    assert len(changes.moves) == state.slots_per_rank and not changes.loads
    model.install_expert_epoch(rotated, changes, CommWithoutPeers((0, 1, 2, 3), 1), tmp_path / "nothing here")
    assert_served(model.checkpoint_weights(), load_file(model_dir / "model.safetensors"))  # scales moved too


def test_a_failed_read_or_changes_that_do_not_fit_change_nothing(tiny_model, tmp_path):
    model_dir = tiny_model("mixtral")
    model, rank = degraded_install(model_dir)
    state = model.expert_parallel
    assert state is not None
    before_map, before = state.expert_map, [t.clone() for t in model.parameters()]
    plan = plan_placement(state.shape, [0, 1, 2], previous=state.expert_map)
    comm = CommWithoutPeers((0, 1, 2), rank)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointFilesMissingError):
        model.install_expert_epoch(plan.expert_map, state.changes_to(plan.expert_map), comm, broken)
    with pytest.raises(ValueError, match="do not take its slots"):
        model.install_expert_epoch(plan.expert_map, plan.changes_of((rank + 1) % 3), comm, model_dir)
    with pytest.raises(ValueError, match="not group index"):
        elsewhere = CommWithoutPeers((0, 1, 2), (rank + 1) % 3)
        model.install_expert_epoch(plan.expert_map, state.changes_to(plan.expert_map), elsewhere, model_dir)
    assert state.expert_map is before_map and state.comm is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_dropping_the_comm_keeps_the_weights_and_stops_the_layers(tiny_model):
    model_dir = tiny_model("mixtral")
    model = ep_model(model_dir, 0, 2, 0)
    state = model.expert_parallel
    assert state is not None
    comm = CommWithoutPeers((0, 1), 0)
    model.install_expert_epoch(state.expert_map, state.changes_to(state.expert_map), comm, model_dir)
    assert state.comm is not None
    model.drop_expert_comm()
    assert state.comm is None and state.routing is None
    with pytest.raises(RuntimeError, match="no expert-parallel epoch"):
        model.run_empty_moe_step()
