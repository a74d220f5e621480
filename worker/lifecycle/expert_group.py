"""The lifecycle's side of expert parallelism: prepare each epoch off the serving path, then let the engine switch.

`POST /group/reconfigure` lands here once the membership checks passed. Preparing an epoch (blocking, on a worker
thread, while the old epoch, if healthy, keeps serving):
1. join the epoch's process group: a fresh rendezvous at the coordinator's group endpoint, where the members also
   check that they all have the same number of expert slots (`epoch_slots`);
2. the epoch's expert map for the epoch's group size (a resize is an epoch of another size): the one the request
   carries, or the coordinator plans it from the map it served last (`tidal.worker.experts.plan_placement`) and
   publishes it in the epoch's store, where the other members read it;
3. stage what this rank must hold and does not: read those experts from the served version's checkpoint into host
   memory. Nothing served changes until here, so any failure refuses the epoch and keeps the old state.
Then the engine's loop switches at a step boundary all staying ranks agree on (`engine.lockstep`), installs the
staged experts (device copies only) and steps with the new group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.contract.control_api import GroupHealth, GroupReconfigureRequest, GroupStatus
from tidal.worker.engine.group_link import GroupLink, PendingEpoch
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.lockstep_engine import LockstepAsyncEngine
from tidal.worker.experts.expert_map import ExpertMap, ExpertMapError, GroupShape, NotEnoughSlotsError
from tidal.worker.experts.placement import plan_placement
from tidal.worker.group.endpoint import GroupEndpoint
from tidal.worker.group.epoch_group import EpochGroup, GroupBackend, join_epoch
from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.group.members import EpochMember
from tidal.worker.lifecycle.epoch_slots import agree_on_slots
from tidal.worker.lifecycle.errors import (
    BadRequestError,
    ExpertsUnavailableError,
    GroupUnreachableError,
    StaleEpochError,
)
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

log = logging.getLogger(__name__)

_MAP_KEY = "expert_map"


@dataclass(frozen=True)
class EpochOutcome:
    expert_map: ExpertMap
    loaded_experts: tuple[int, ...]
    degraded_experts: tuple[int, ...]
    reload_s: float
    duration_s: float


class ExpertGroup:
    def __init__(
        self,
        rank: int,
        endpoint: GroupEndpoint,
        engine: LockstepAsyncEngine,
        model: MoeDecoderForCausalLM,
        device: torch.device,
        collective_timeout_s: float,
        backend: GroupBackend,
        checkpoint_dir: Callable[[], Path | None],
        on_installed: Callable[[LLMEngine], None],
    ) -> None:
        """`checkpoint_dir`: where the served version can be re-read (None: it cannot, e.g. it was streamed);
        `on_installed`: called on the loop thread after an epoch's experts are installed (the residency refreshes
        what it expects of a checkpoint)."""
        self.rank = rank
        self.endpoint = endpoint
        self.engine = engine
        self.link: GroupLink = engine.link
        if model.expert_parallel is None:
            raise ValueError("the model was not built for expert parallelism")
        self.model = model
        self.experts = model.expert_parallel
        self.device = device
        self.collective_timeout_s = collective_timeout_s
        self.backend: GroupBackend = backend
        self._checkpoint_dir = checkpoint_dir
        self._on_installed = on_installed
        self.last: EpochOutcome | None = None

    async def join(self, request: GroupReconfigureRequest, group_size: int) -> EpochOutcome:
        """Prepare the epoch (of `group_size` ranks), hand it to the engine and wait until the loop switched to it."""
        start = time.monotonic()
        pending, outcome = await asyncio.to_thread(self._prepare, request, group_size, start)
        try:
            self.link.offer(pending)
        except GroupBrokenError as err:  # a newer epoch was asked for and prepared meanwhile
            raise StaleEpochError(f"epoch {request.epoch} was not switched to: {err}") from err
        self.engine.notify_group_changed()
        try:
            await asyncio.wait_for(asyncio.wrap_future(pending.switched), request.timeout_s)
        except TimeoutError:
            self.link.withdraw(pending)
            raise GroupUnreachableError(
                f"epoch {request.epoch} was prepared but the staying ranks did not all switch to it within "
                f"{request.timeout_s:g}s (a member is missing or paused); the previous epoch is kept"
            ) from None
        except GroupBrokenError as err:
            raise GroupUnreachableError(f"epoch {request.epoch} was not switched to: {err}") from err
        self.last = outcome = EpochOutcome(
            outcome.expert_map, outcome.loaded_experts, outcome.degraded_experts, outcome.reload_s,
            time.monotonic() - start,
        )  # fmt: skip
        return outcome

    def _prepare(
        self, request: GroupReconfigureRequest, group_size: int, start: float
    ) -> tuple[PendingEpoch, EpochOutcome]:
        members = [EpochMember(m.rank, m.address) for m in sorted(request.members, key=lambda m: m.rank)]
        try:
            group = join_epoch(
                request.epoch, members, self.rank, request.coordinator_rank, self.device,
                timeout_s=request.timeout_s, collective_timeout_s=self.collective_timeout_s, backend=self.backend,
            )  # fmt: skip
        except GroupBrokenError as err:
            raise GroupUnreachableError(f"could not join epoch {request.epoch}: {err}") from err
        try:
            ranks = [m.rank for m in members]
            try:
                agree_on_slots(group, request.epoch, ranks, self.rank, self.experts.slots_per_rank,
                               request.coordinator_rank, request.timeout_s)  # fmt: skip
            except GroupBrokenError as err:
                raise GroupUnreachableError(f"epoch {request.epoch}: a member's slot count is missing: {err}") from err
            expert_map, degraded = self._epoch_map(request, self.experts.shape_for(group_size), group)
            mine = self.experts.changes_to(expert_map)
            reload_start = time.monotonic()
            checkpoint = self._checkpoint_dir()
            if mine.loads and checkpoint is None:
                raise ExpertsUnavailableError(
                    f"epoch {request.epoch} needs experts {list(mine.loaded_experts)} on rank {self.rank}, but the "
                    "served weights came from a stream or a broadcast and cannot be re-read; send a weight update "
                    "from a directory first. The previous epoch is kept."
                )
            try:
                staged = self.model.stage_expert_epoch(expert_map, mine, group, checkpoint)
            except ValueError as err:
                raise BadRequestError(f"epoch {request.epoch} does not fit this rank: {err}") from err
            except Exception as err:
                raise ExpertsUnavailableError(
                    f"epoch {request.epoch}: could not read experts {list(mine.loaded_experts)} from {checkpoint}: "
                    f"{err}; the previous epoch is kept"
                ) from err
            reload_s = time.monotonic() - reload_start
        except BaseException:
            group.close()
            raise

        def install(llm: LLMEngine) -> None:
            self.model.apply_expert_epoch(staged)
            self._on_installed(llm)

        outcome = EpochOutcome(expert_map, mine.loaded_experts, degraded, reload_s, time.monotonic() - start)
        return PendingEpoch(group, install), outcome

    def _epoch_map(
        self, request: GroupReconfigureRequest, shape: GroupShape, group: EpochGroup
    ) -> tuple[ExpertMap, tuple[int, ...]]:
        """The epoch's map for `shape` (the epoch's group size) and its degraded experts (held by no member before)."""
        members = sorted(m.rank for m in request.members)
        if request.expert_map is not None:
            try:
                expert_map = ExpertMap.from_json(request.expert_map)
                expert_map.check_fits(shape, members)
            except ExpertMapError as err:
                raise BadRequestError(f"expert_map of epoch {request.epoch} is not usable: {err}") from err
            return expert_map, ()
        if self.rank == request.coordinator_rank:
            try:
                plan = plan_placement(shape, members, self.experts.expert_map)
            except NotEnoughSlotsError as err:
                group.publish(_MAP_KEY, json.dumps({"error": str(err)}).encode())  # the others refuse it too
                raise ExpertsUnavailableError(f"epoch {request.epoch} refused: {err}") from err
            body = {"map": plan.expert_map.to_json(), "degraded": list(plan.missing_experts)}
            group.publish(_MAP_KEY, json.dumps(body).encode())
            return plan.expert_map, plan.missing_experts
        try:
            raw = group.fetch(_MAP_KEY, request.timeout_s)
        except GroupBrokenError as err:
            raise GroupUnreachableError(
                f"epoch {request.epoch}: no expert map from coordinator rank {request.coordinator_rank}: {err}"
            ) from err
        body = json.loads(raw)
        if "error" in body:
            raise ExpertsUnavailableError(f"epoch {request.epoch} refused by its coordinator: {body['error']}")
        try:
            expert_map = ExpertMap.from_json(body["map"])
            expert_map.check_fits(shape, members)
        except ExpertMapError as err:  # the coordinator was sent another group_size, or runs other code
            raise BadRequestError(f"the coordinator's map of epoch {request.epoch} does not fit: {err}") from err
        return expert_map, tuple(body["degraded"])

    # ----- /state -----
    def status(self, group_size: int, members: list[int]) -> GroupStatus:
        """`group_size`, `members`: the current epoch's (the membership's). The members are reported whatever the
        health: a broken epoch's members are what the operator needs to tell the survivors from the failed."""
        link = self.link
        group, broken = link.group, link.broken
        if group is not None:
            health = GroupHealth.SERVING
        elif broken is not None:
            health = GroupHealth.BROKEN
        else:
            health = GroupHealth.WAITING
        last = self.last
        return GroupStatus(
            health=health,
            members=members,
            group_size=group_size,
            slots_per_rank=self.experts.slots_per_rank,
            broken_peer_rank=broken.peer_rank if broken is not None else None,
            broken_reason=broken.reason if broken is not None else None,
            broken_for_s=max(0.0, time.monotonic() - broken.since) if broken is not None else None,
            expert_map=self.experts.expert_map.to_json(),
            held_experts=list(self.experts.slots),
            degraded_experts=list(last.degraded_experts) if last is not None else [],
            expert_reload_s=last.reload_s if last is not None else None,
            epoch_steps=link.epoch_steps,
            waiting_on=link.waiting_on if group is not None else None,
        )
