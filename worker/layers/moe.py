"""The mixture-of-experts block: a router, experts stacked for tidal.kernels.fused_moe, an optional shared expert.

The experts of a layer live in two stacked tensors, w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I], which the fused kernel reads directly (Triton on a GPU, the torch reference on a CPU). Checkpoints
store one tensor per expert and projection; `checkpoint_tensors` names a view into the stack for each, so
loading, in-place weight updates, sleep/wake and checksums see the checkpoint's tensors and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.kernels.fused_moe import fused_moe
from tidal.worker.layers.checkpoint import new_weight
from tidal.worker.layers.linear import Linear
from tidal.worker.layers.mlp import GatedMLP


@dataclass(frozen=True)
class ExpertCheckpointNames:
    """How a family's checkpoint spells an MoE block: `block` is its name beside self_attn (the decoder keeps the
    module at `mlp`), `router` the router's name under it, and each expert's projections are
    `<block>.experts.<e>.<gate|up|down>.weight`."""

    block: str
    router: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class MoeSpec:
    """A family's expert settings, from its config."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # the top-k routing weights rescaled to sum to one (Mixtral; norm_topk_prob of the Qwens)
    names: ExpertCheckpointNames
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate


class SparseMoE(nn.Module):
    """x [T, H] -> sum over the top-k experts of weight * expert(x), plus the gated shared expert if there is one."""

    def __init__(self, hidden_size: int, moe: MoeSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        num_experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.moe = moe
        self.router = new_weight((num_experts, hidden_size), dtype, device)  # [E, H]
        self.w13 = new_weight((num_experts, 2 * inter, hidden_size), dtype, device)  # [E, 2I, H]: gate, then up
        self.w2 = new_weight((num_experts, hidden_size, inter), dtype, device)  # [E, H, I]
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            # Submodules name their own checkpoint tensors from their module path (...mlp.shared_expert...), which
            # matches only where the checkpoint's block is called `mlp` as the decoder's module is.
            if moe.names.block != "mlp":
                raise ValueError(f"a shared expert needs the checkpoint block to be 'mlp', not {moe.names.block!r}")
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, False, dtype, device)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = F.linear(x, self.router)  # [T, E]
        out = fused_moe(x, self.w13, self.w2, router_logits, self.moe.top_k, self.moe.renormalize)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # gate [T, 1]
        return out

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """The router and one view per expert projection, under the family's block name beside `path`."""
        names = self.moe.names
        block = f"{path.rsplit('.', 1)[0]}.{names.block}"
        inter = self.moe.expert_intermediate_size
        tensors = {f"{block}.{names.router}.weight": self.router.data}
        for e in range(self.moe.num_experts):
            expert = f"{block}.experts.{e}"
            tensors[f"{expert}.{names.gate}.weight"] = self.w13.data[e, :inter]  # [I, H]
            tensors[f"{expert}.{names.up}.weight"] = self.w13.data[e, inter:]  # [I, H]
            tensors[f"{expert}.{names.down}.weight"] = self.w2.data[e]  # [H, I]
        return tensors
