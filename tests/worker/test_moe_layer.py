"""The mixture-of-experts layer against a plain loop over experts, its checkpoint views, and which layers the
families make sparse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from tidal.worker.layers.moe import ExpertCheckpointNames, MoeSpec, SparseMoE
from tidal.worker.models.mixtral import MIXTRAL_EXPERT_NAMES
from tidal.worker.models.qwen_moe import QWEN_MOE_EXPERT_NAMES, qwen_dense_mlp_layers

CPU = torch.device("cpu")
HIDDEN, INTER, EXPERTS = 16, 8, 6


def filled_layer(names: ExpertCheckpointNames, renormalize: bool, shared: int) -> SparseMoE:
    spec = MoeSpec(EXPERTS, 2, INTER, renormalize, names, shared_expert_intermediate_size=shared)
    layer = SparseMoE(HIDDEN, spec, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    for tensor in layer.parameters():
        tensor.data.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)
    return layer


def expert_loop(layer: SparseMoE, x: torch.Tensor, path: str) -> torch.Tensor:
    """The block computed from the checkpoint-named tensors alone, one token and one chosen expert at a time."""
    names, spec = layer.moe.names, layer.moe
    block = f"{path.rsplit('.', 1)[0]}.{names.block}"
    weights = layer_tensors(layer, path)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.linear(x[t], weights[f"{block}.{names.router}.weight"]).softmax(-1)
        top, ids = probs.topk(spec.top_k)
        if spec.renormalize:
            top = top / top.sum()
        for w, e in zip(top.tolist(), ids.tolist(), strict=True):
            expert = f"{block}.experts.{e}"
            gate = F.linear(x[t], weights[f"{expert}.{names.gate}.weight"])
            up = F.linear(x[t], weights[f"{expert}.{names.up}.weight"])
            out[t] += w * F.linear(F.silu(gate) * up, weights[f"{expert}.{names.down}.weight"])
        if spec.shared_expert_intermediate_size:
            shared = f"{block}.shared_expert"
            gate = F.linear(x[t], weights[f"{shared}.gate_proj.weight"])
            up = F.linear(x[t], weights[f"{shared}.up_proj.weight"])
            dense = F.linear(F.silu(gate) * up, weights[f"{shared}.down_proj.weight"])
            out[t] += torch.sigmoid(F.linear(x[t], weights[f"{block}.shared_expert_gate.weight"])) * dense
    return out


def layer_tensors(layer: SparseMoE, path: str) -> dict[str, torch.Tensor]:
    """What collect_checkpoint_tensors gives for the layer placed at `path`."""
    tensors: dict[str, torch.Tensor] = {}
    for sub, module in layer.named_modules():
        if hasattr(module, "checkpoint_tensors"):
            tensors.update(module.checkpoint_tensors(f"{path}.{sub}" if sub else path))
    return tensors


@pytest.mark.parametrize(
    ("names", "renormalize", "shared"),
    [(MIXTRAL_EXPERT_NAMES, True, 0), (QWEN_MOE_EXPERT_NAMES, False, 12), (QWEN_MOE_EXPERT_NAMES, True, 0)],
)
def test_the_layer_equals_a_loop_over_experts_of_the_checkpoint_tensors(names, renormalize, shared):
    layer = filled_layer(names, renormalize, shared)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), expert_loop(layer, x, "model.layers.3.mlp"), rtol=1e-5, atol=1e-5)


def test_checkpoint_views_tile_the_stacked_experts_under_the_family_block_name():
    layer = filled_layer(MIXTRAL_EXPERT_NAMES, True, 0)
    tensors = layer_tensors(layer, "model.layers.3.mlp")
    assert all(name.startswith("model.layers.3.block_sparse_moe.") for name in tensors)
    assert len(tensors) == 1 + 3 * EXPERTS
    assert sum(t.numel() for t in tensors.values()) == sum(p.numel() for p in layer.parameters())
    w1 = tensors["model.layers.3.block_sparse_moe.experts.4.w1.weight"]
    w3 = tensors["model.layers.3.block_sparse_moe.experts.4.w3.weight"]
    w2 = tensors["model.layers.3.block_sparse_moe.experts.4.w2.weight"]
    assert w1.shape == w3.shape == (INTER, HIDDEN) and w2.shape == (HIDDEN, INTER)
    assert w1.is_contiguous() and w3.is_contiguous() and w2.is_contiguous()
    # Views, not copies: a weight update through the checkpoint name reaches what the forward reads.
    assert w1.data_ptr() == layer.w13[4].data_ptr()
    assert w3.data_ptr() == layer.w13[4, INTER:].data_ptr()
    assert w2.data_ptr() == layer.w2[4].data_ptr()


def test_a_shared_expert_needs_the_mlp_block_name():
    names = ExpertCheckpointNames("block_sparse_moe", "gate", "w1", "w3", "w2")
    with pytest.raises(ValueError, match="shared expert"):
        SparseMoE(HIDDEN, MoeSpec(EXPERTS, 2, INTER, True, names, 4), torch.float32, CPU)


@pytest.mark.parametrize(
    ("config_class", "fields", "dense"),
    [
        (Qwen3MoeConfig, {"num_hidden_layers": 4}, set()),
        (Qwen3MoeConfig, {"num_hidden_layers": 4, "mlp_only_layers": [0, 2]}, {0, 2}),
        (Qwen2MoeConfig, {"num_hidden_layers": 6, "decoder_sparse_step": 2}, {0, 2, 4}),
        (Qwen2MoeConfig, {"num_hidden_layers": 6, "decoder_sparse_step": 3, "mlp_only_layers": [5]}, {0, 1, 3, 4, 5}),
        (Qwen3MoeConfig, {"num_hidden_layers": 3, "num_experts": 0}, {0, 1, 2}),
    ],
)
def test_qwen_dense_layers_follow_mlp_only_layers_and_the_sparse_step(config_class, fields, dense):
    assert qwen_dense_mlp_layers(config_class(**fields)) == dense
