"""The mixture-of-experts block: a router, experts stacked for tidal.kernels.fused_moe, an optional shared expert.

The experts of a layer live in two stacked tensors, w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I], which the fused kernel reads directly (Triton on a GPU, the torch reference on a CPU). Checkpoints
store one tensor per expert and projection; `checkpoint_tensors` names a view into the stack for each, so
loading, in-place weight updates, sleep/wake and checksums see the checkpoint's tensors and nothing else.

With expert parallelism (an `ExpertParallelState`, see expert_parallel.py) the stacks hold this rank's S slots
instead of all E experts, the checkpoint names follow what the slots hold (an expert this rank does not hold has no
name here), and the forward dispatches each (token, expert) to a rank holding that expert (expert_dispatch.py).

With FP8 experts (`hold_fp8`, chosen by tidal.worker.layers.fp8_weights) the stacks are e4m3 and two more stacks hold
one fp32 scale per output channel of each expert (w13_scale [E, 2I], w2_scale [E, H]); each expert projection is
then served as `<...>.weight` and `<...>.weight_scale`, as an FP8 `Linear` is, so the readers that quantize a
16-bit checkpoint on the way in (checkpoint/fp8_targets.py) treat experts and dense projections alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.kernels._moe_small_batch_config import SmallBatchMoeConfig
from tidal.kernels.fused_moe import auto_small_batch_config, fused_moe, fused_moe_into_residual_triton, topk_route
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.moe_expert_scales import ExpertScales
from tidal.kernels.small_batch_linear import NormInput, linear_rows_triton
from tidal.worker.layers.checkpoint import new_weight
from tidal.worker.layers.expert_dispatch import dispatch_and_combine
from tidal.worker.layers.expert_parallel import ExpertParallelState
from tidal.worker.layers.linear import Linear
from tidal.worker.layers.mlp import GatedMLP

# "0" keeps expert layers out of the decoder's small-batch path (SparseMoE.small_batch_config): for A/B timing.
FUSED_LAYER_SWITCH = "TIDAL_MOE_FUSED_LAYER"


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
    """x [T, H] -> sum over the top-k experts of weight * expert(x), plus the gated shared expert if there is one.

    `expert_parallel`: the model's shared state when its experts are spread over a group; the stacks then have one
    entry per slot of this rank (S) rather than per expert (E)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoeSpec,
        dtype: torch.dtype,
        device: torch.device,
        expert_parallel: ExpertParallelState | None = None,
    ) -> None:
        super().__init__()
        num_experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.moe = moe
        self.expert_parallel = expert_parallel
        # TIDAL_MOE_FUSED_LAYER=0 keeps the unfused forward at every token count (an A/B between processes, as
        # profile_steps.py runs it); read once here, not on every step. A benchmark may set the flag per layer.
        self.fuses_into_layer = os.environ.get(FUSED_LAYER_SWITCH, "1") != "0"
        stacked = num_experts if expert_parallel is None else expert_parallel.slots_per_rank
        self.router = new_weight((num_experts, hidden_size), dtype, device)  # [E, H]
        self.w13 = new_weight((stacked, 2 * inter, hidden_size), dtype, device)  # [E or S, 2I, H]: gate, then up
        self.w2 = new_weight((stacked, hidden_size, inter), dtype, device)  # [E or S, H, I]
        self.w13_scale: nn.Parameter | None = None  # [E or S, 2I] fp32 with FP8 experts
        self.w2_scale: nn.Parameter | None = None  # [E or S, H] fp32 with FP8 experts
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            # Submodules name their own checkpoint tensors from their module path (...mlp.shared_expert...), which
            # matches only where the checkpoint's block is called `mlp` as the decoder's module is.
            if moe.names.block != "mlp":
                raise ValueError(f"a shared expert needs the checkpoint block to be 'mlp', not {moe.names.block!r}")
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, False, dtype, device)
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype, device)

    def hold_fp8(self) -> None:
        """From now on the expert stacks are e4m3 with a scale per output channel of each expert (the module
        docstring). Only before the parameters are placed (on the meta device), as for `Linear.hold_fp8`."""
        if not self.w13.is_meta:
            raise RuntimeError("FP8 weights are chosen before a model's parameters are placed")
        device = self.w13.device
        self.w13 = new_weight(tuple(self.w13.shape), FP8_E4M3, device)
        self.w2 = new_weight(tuple(self.w2.shape), FP8_E4M3, device)
        self.w13_scale = new_weight(tuple(self.w13.shape[:2]), torch.float32, device)
        self.w2_scale = new_weight(tuple(self.w2.shape[:2]), torch.float32, device)

    @property
    def scales(self) -> ExpertScales | None:
        """The FP8 stacks' scales as the kernels take them; None for 16-bit experts."""
        if self.w13_scale is None or self.w2_scale is None:
            return None
        return ExpertScales(self.w13_scale, self.w2_scale)

    def stacks(self) -> list[nn.Parameter]:
        """Every parameter with one entry per held expert (the weight stacks, and the scales with FP8 experts): what
        moves with an expert when it changes slot, and what a step reads only the touched entries of."""
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = F.linear(x, self.router)  # [T, E]
        if self.expert_parallel is None:
            out = fused_moe(x, self.w13, self.w2, router_logits, self.moe.top_k, self.moe.renormalize, self.scales)
        else:
            weights, ids = topk_route(router_logits, self.moe.top_k, self.moe.renormalize)  # [T, k] each
            comm, routing = self.expert_parallel.epoch()
            out = dispatch_and_combine(
                x, weights, ids, self.w13, self.w2, comm, routing, self.expert_parallel.exchange, self.scales
            )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # gate [T, 1]
        return out

    def small_batch_config(self, num_tokens: int) -> SmallBatchMoeConfig | None:
        """The small-batch expert kernels' config where a step of `num_tokens` runs this block in the decoder's
        small-batch path (`forward_small_batch`), else None (also where the config measured the unfused layers
        faster at this count, `fuse_into_layer`). Expert parallelism (a dispatch to other ranks) and a
        shared expert keep the unfused forward, and so does `fuses_into_layer` False (TIDAL_MOE_FUSED_LAYER=0:
        timing the two against each other; the unfused layers still take the small-batch expert kernels)."""
        if self.expert_parallel is not None or self.shared_expert is not None or not self.fuses_into_layer:
            return None
        config = auto_small_batch_config(num_tokens, self.moe.top_k, self.w13)
        return config if config is not None and config.fuse_into_layer else None

    def forward_small_batch(
        self, x: NormInput, eps: float, residual: torch.Tensor, next_gamma: torch.Tensor
    ) -> tuple[torch.Tensor, NormInput]:
        """residual + forward(rms_norm(h)) for a few tokens (where `small_batch_config` gives a config), from the
        norm's unscaled input `x` and its `eps`, in three launches: the router's projection scaled by 1/rms,
        routing + gate/up scaled by 1/rms + SiLU-and-mul, down summed over each token's experts and added into the
        residual stream with the next norm's input (weight `next_gamma`) in its epilogue. -> (the new residual
        stream [T, H], that input)."""
        config = self.small_batch_config(x.scaled.shape[0])
        if config is None:
            raise ValueError(f"{x.scaled.shape[0]} tokens do not take the small-batch expert kernels here")
        router_logits = linear_rows_triton(x.scaled, self.router, None, x.partial_sq, eps)  # [T, E]
        return fused_moe_into_residual_triton(
            x, eps, self.w13, self.w2, router_logits, self.moe.top_k, self.moe.renormalize, residual, next_gamma,
            config, self.scales,
        )  # fmt: skip

    def checkpoint_block(self, path: str) -> str:
        """The checkpoint's prefix of this block, for the layer at module path `path` (the decoder's `...mlp`)."""
        return f"{path.rsplit('.', 1)[0]}.{self.moe.names.block}"

    def stacked_experts(self) -> list[tuple[int, int]]:
        """(index in the stacks, logical expert) of every expert the stacks hold."""
        if self.expert_parallel is None:
            return [(e, e) for e in range(self.moe.num_experts)]
        return [(slot, e) for slot, e in enumerate(self.expert_parallel.slots) if e is not None]

    def expert_tensors(self, block: str, index: int, expert: int) -> dict[str, torch.Tensor]:
        """Logical expert `expert`'s checkpoint names under `block`, as views of entry `index` of the stacks (and
        of the scale stacks, as `<...>.weight_scale`, with FP8 experts)."""
        names, inter = self.moe.names, self.moe.expert_intermediate_size
        prefix = f"{block}.experts.{expert}"
        tensors = {
            f"{prefix}.{names.gate}.weight": self.w13.data[index, :inter],  # [I, H]
            f"{prefix}.{names.up}.weight": self.w13.data[index, inter:],  # [I, H]
            f"{prefix}.{names.down}.weight": self.w2.data[index],  # [H, I]
        }
        if self.w13_scale is not None and self.w2_scale is not None:
            tensors[f"{prefix}.{names.gate}.weight_scale"] = self.w13_scale.data[index, :inter]  # [I]
            tensors[f"{prefix}.{names.up}.weight_scale"] = self.w13_scale.data[index, inter:]  # [I]
            tensors[f"{prefix}.{names.down}.weight_scale"] = self.w2_scale.data[index]  # [H]
        return tensors

    def expert_of(self, block: str, name: str) -> int | None:
        """The logical expert a checkpoint name of this block's experts belongs to; None for any other name."""
        head, dot, tail = name.partition(".experts.")
        expert, _, projection = tail.partition(".")
        names = self.moe.names
        if head != block or not dot or not expert.isdigit() or not 0 <= int(expert) < self.moe.num_experts:
            return None
        projections = {f"{p}.{kind}" for p in (names.gate, names.up, names.down) for kind in ("weight", "weight_scale")}
        return int(expert) if projection in projections else None

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """The router and one view per projection of each expert the stacks hold, under the family's block name
        beside `path`."""
        block = self.checkpoint_block(path)
        tensors = {f"{block}.{self.moe.names.router}.weight": self.router.data}
        for index, expert in self.stacked_experts():
            tensors.update(self.expert_tensors(block, index, expert))
        return tensors
