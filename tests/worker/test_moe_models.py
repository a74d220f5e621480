"""The mixture-of-experts families beyond greedy equality (test_engine_vs_transformers covers that): the checkpoint
names are those transformers writes, load into views of the stacked experts, and the lifecycle (sleep/wake, an
in-place update, the checksum) works on them unchanged."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tidal.contract.control_api import SleepRequest, WakeUpRequest, WeightsUpdateRequest
from tidal.worker.layers.moe import FUSED_LAYER_SWITCH, ExpertCheckpointNames, MoeSpec, SparseMoE
from tidal.worker.lifecycle.checksum import tensor_digest
from tidal.worker.loader.model_loader import load_model
from tidal.worker.testing.hf_reference import load_reference_model, prompt_ids, transformers_greedy
from tidal.worker.testing.in_process import greedy, running_manager
from tidal.worker.testing.tiny_models import write_tiny_model

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
CPU = torch.device("cpu")


def shapes_on_disk(path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_checkpoint_names_are_what_transformers_saves(arch, tiny_model, tmp_path):
    # transformers v5 fuses the experts in memory and splits them back per expert on save: our names must be the
    # saved ones, which are what released checkpoints of these families hold.
    model_dir = tiny_model(arch)
    load_reference_model(model_dir).save_pretrained(tmp_path)
    assert shapes_on_disk(tmp_path / "model.safetensors") == shapes_on_disk(model_dir / "model.safetensors")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_tensors_load_into_views_of_the_stacked_weights(arch, tiny_model):
    model_dir = tiny_model(arch)
    loaded = load_model(model_dir, "auto", CPU)
    weights = loaded.model.checkpoint_weights()
    on_disk = load_file(model_dir / "model.safetensors")
    assert set(weights) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(weights[name], tensor), name
    for i, layer in enumerate(loaded.model.model.layers):
        if not hasattr(layer.mlp, "w13"):
            continue
        stacks = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (layer.mlp.w13, layer.mlp.w2)]
        experts = [w for name, w in weights.items() if name.startswith(f"model.layers.{i}.") and ".experts." in name]
        assert len(experts) == 3 * layer.mlp.moe.num_experts
        assert all(any(lo <= w.data_ptr() < hi for lo, hi in stacks) for w in experts)


def test_qwen3_moe_keeps_dense_mlp_only_layers(tiny_model):
    loaded = load_model(tiny_model("qwen3_moe"), "auto", CPU)
    sparse = [hasattr(layer.mlp, "w13") for layer in loaded.model.model.layers]
    assert sparse == [True, True, False, True]
    assert "model.layers.2.mlp.gate_proj.weight" in loaded.model.checkpoint_weights()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_sleep_wake_and_an_update_serve_transformers_outputs(arch, tiny_model, tmp_path):
    model_dir = tiny_model(arch)
    version_b = write_tiny_model(arch, tmp_path / "b", sharded=True, seed=7)
    prompts = prompt_ids(model_dir)[:5]
    expected_b = transformers_greedy(version_b, prompts, 12)
    b_digests = {
        name: tensor_digest(t) for name, t in load_model(version_b, "auto", CPU).model.checkpoint_weights().items()
    }

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before = await greedy(manager, prompts)
            await manager.sleep(SleepRequest(level=1))
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, prompts) == before
            await manager.sleep(SleepRequest(level=2))
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, prompts) == before
            await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            assert await greedy(manager, prompts) == expected_b != before
            checksum = await manager.checksum(recompute=True)
            assert checksum.version == "b" and checksum.tensors == b_digests

    asyncio.run(scenario())


def test_expert_layers_join_the_small_batch_path_where_measured_faster(monkeypatch):
    """Qwen3-30B-A3B's expert shape: fused at 1-2 tokens, unfused around the same expert kernels at 4-8 (its tuned
    configs), the grouped GEMMs past 8; TIDAL_MOE_FUSED_LAYER=0 keeps every count unfused."""
    names = ExpertCheckpointNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")
    spec = MoeSpec(num_experts=128, top_k=8, expert_intermediate_size=768, renormalize=True, names=names)
    layer = SparseMoE(2048, spec, torch.bfloat16, torch.device("meta"))
    fused = {tokens: layer.small_batch_config(tokens) is not None for tokens in (1, 2, 4, 8, 9)}
    assert fused == {1: True, 2: True, 4: False, 8: False, 9: False}
    monkeypatch.setenv(FUSED_LAYER_SWITCH, "0")
    assert SparseMoE(2048, spec, torch.bfloat16, torch.device("meta")).small_batch_config(1) is None
    layer.fuses_into_layer = False  # what a benchmark sets for one eager step
    assert layer.small_batch_config(1) is None
