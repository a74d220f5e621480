"""The decoder with mixture-of-experts blocks in place of (some of) its dense MLPs; the families' shared part.

A family gives its attention settings (`spec_from_config`, as the dense families do), its expert settings
(`moe_spec_from_config`) and which layers keep a dense MLP (`dense_mlp_layers`). A decode step of a few tokens takes
the decoder's small-batch path where every expert layer's small-batch kernels serve that count
(`DecoderLayer.fuses_small_batch`); expert parallelism and a shared expert keep the unfused forward.

Built for an expert-parallel group of more than one rank, every expert layer holds this rank's slots and shares one
`ExpertParallelState` (`expert_parallel`); the checkpoint names cover the router and the held experts only, and the
other experts' names are ignored, so loading, weight updates and checksums see exactly what this rank serves. The
engine then installs epochs (`install_expert_epoch`), runs `run_empty_moe_step` when it has no tokens while its
peers step, and `drop_expert_comm` when the group breaks.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Self

import torch
from torch import nn
from transformers import PretrainedConfig

from tidal.worker.experts.changes import RankChanges
from tidal.worker.experts.expert_map import ExpertMap
from tidal.worker.layers.attention import AttentionBatch
from tidal.worker.layers.expert_install import (
    ExpertInstallReport,
    StagedEpoch,
    apply_epoch,
    install_epoch,
    stage_epoch,
)
from tidal.worker.layers.expert_parallel import ExpertComm, ExpertParallelSettings, ExpertParallelState
from tidal.worker.layers.moe import MoeSpec, SparseMoE
from tidal.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    @classmethod
    @abstractmethod
    def moe_spec_from_config(cls, cfg: PretrainedConfig) -> MoeSpec: ...

    @classmethod
    def dense_mlp_layers(cls, cfg: PretrainedConfig) -> frozenset[int]:
        """Layers with the dense MLP (of `intermediate_size`) instead of experts; none by default."""
        return frozenset()

    @classmethod
    def from_hf_config(
        cls,
        hf_config: PretrainedConfig,
        dtype: torch.dtype,
        device: torch.device,
        expert_parallel: ExpertParallelSettings | None = None,
    ) -> Self:
        spec = cls.spec_from_config(hf_config)
        moe, dense = cls.moe_spec_from_config(hf_config), cls.dense_mlp_layers(hf_config)
        return cls(spec, moe, dense, dtype, device, expert_parallel)

    def __init__(
        self,
        spec: DecoderSpec,
        moe: MoeSpec,
        dense_layers: frozenset[int],
        dtype: torch.dtype,
        device: torch.device,
        expert_parallel: ExpertParallelSettings | None = None,
    ) -> None:
        # Set before the decoder's constructor, which calls make_mlp; plain values, so nn.Module allows it early.
        self.moe = moe
        self.dense_layers = dense_layers
        has_experts = moe.num_experts > 0 and len(dense_layers) < spec.num_layers
        if expert_parallel is not None and expert_parallel.is_parallel and has_experts:
            self.expert_parallel = ExpertParallelState(expert_parallel, moe.num_experts)
        super().__init__(spec, dtype, device)
        # The expert layers by module path, in layer order (the order every rank runs their collectives in).
        self.expert_layers: tuple[tuple[str, SparseMoE], ...] = tuple(
            (path, module) for path, module in self.named_modules() if isinstance(module, SparseMoE)
        )
        self._expert_blocks = {layer.checkpoint_block(path): layer for path, layer in self.expert_layers}

    def make_mlp(self, spec: DecoderSpec, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if layer_idx in self.dense_layers:
            return super().make_mlp(spec, layer_idx, dtype, device)
        return SparseMoE(spec.hidden_size, self.moe, dtype, device, self.expert_parallel)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        # Another rank's experts: known to the model, not held here.
        return super().ignored_checkpoint_tensor(name) or self._is_unheld_expert(name)

    def _is_unheld_expert(self, name: str) -> bool:
        state = self.expert_parallel
        if state is None:
            return False
        block = name.partition(".experts.")[0]
        layer = self._expert_blocks.get(block)
        expert = None if layer is None else layer.expert_of(block, name)
        return expert is not None and expert not in state.held_experts

    # ----- expert parallelism (only with `expert_parallel`) -----
    def install_expert_epoch(
        self, expert_map: ExpertMap, changes: RankChanges, comm: ExpertComm, checkpoint_dir: Path | None
    ) -> ExpertInstallReport:
        """Serve `expert_map` through `comm`, loading from `checkpoint_dir` the experts this rank must now hold
        (`changes`: `expert_parallel.changes_to(expert_map)`). On ValueError or CheckpointError nothing changed."""
        return install_epoch(self._state(), self.expert_layers, expert_map, changes, comm, checkpoint_dir)

    def stage_expert_epoch(
        self, expert_map: ExpertMap, changes: RankChanges, comm: ExpertComm, checkpoint_dir: Path | None
    ) -> StagedEpoch:
        """The first half of `install_expert_epoch`: checks and reads, touching nothing served (any thread)."""
        return stage_epoch(self._state(), self.expert_layers, expert_map, changes, comm, checkpoint_dir)

    def apply_expert_epoch(self, staged: StagedEpoch) -> None:
        """The second half: device copies and the switch of map, comm and routing (between steps)."""
        apply_epoch(self._state(), self.expert_layers, staged)

    def drop_expert_comm(self) -> None:
        """The group broke: forget its comm (a MoE layer refuses to run until the next epoch); weights stay."""
        self._state().drop_comm()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, batch)
        self._count_group_step()  # once it went through: a step the group broke in is run again and counted then
        return hidden

    def run_empty_moe_step(self) -> None:
        """This rank's share of a step it has no tokens for: every MoE layer, in order, on zero tokens, serving the
        rows its peers send."""
        for _, layer in self.expert_layers:
            layer(layer.router.new_empty((0, layer.router.shape[1])))
        self._count_group_step()

    def _count_group_step(self) -> None:
        """A forward (or empty step) of a group of more than one: its exchanges' totals count it, so that a reader
        gets per-step figures from one scrape."""
        state = self.expert_parallel
        if state is not None and state.comm is not None and state.comm.size > 1:
            state.exchange.count_step()

    def _state(self) -> ExpertParallelState:
        if self.expert_parallel is None:
            raise RuntimeError("this model was not built for expert parallelism (world_size 1 or no expert layers)")
        return self.expert_parallel
