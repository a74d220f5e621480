"""The worker's lifecycle as the control API sees it: sleep and wake, weight updates and checksums, in order.

`Residency` does the blocking work (copies, reads, a collective) on the engine's regions; this class builds the engine
in releasable memory (`load_engine`) and binds a Residency to it, runs each operation on a worker thread, one at a time
(a second one while one runs is refused as busy), keeps the checksum cache and the metrics, and is the engine's
admission gate for requests that arrive while the model sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

from tidal.contract.control_api import (
    CollectiveUpdateRequest,
    DrainMode,
    GroupHealth,
    GroupReconfigureRequest,
    GroupReconfigureResult,
    GroupStatus,
    ResidentTag,
    SleepRequest,
    SleepState,
    StreamFinishRequest,
    TransitionResult,
    WakeUpRequest,
    WeightsChecksum,
    WeightsUpdateRequest,
    WeightsUpdateResult,
    WorkerState,
)
from tidal.worker.checkpoint.errors import some_of
from tidal.worker.checkpoint.fp8_targets import plan_expected
from tidal.worker.checkpoint.judge import Candidate, find_problems
from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.engine.async_engine import AsyncEngine, EngineNotRunningError
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.group_link import GroupLink
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.lockstep_engine import LockstepAsyncEngine
from tidal.worker.group.endpoint import GroupEndpoint
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.lifecycle.errors import (
    BusyError,
    CheckpointRejectedError,
    DrainTimeoutError,
    LifecycleError,
    NotLoadedError,
    StaleEpochError,
)
from tidal.worker.lifecycle.expert_group import ExpertGroup
from tidal.worker.lifecycle.membership import GroupMembership
from tidal.worker.lifecycle.metrics import LifecycleMetrics
from tidal.worker.lifecycle.residency import ALL_TAGS, Residency
from tidal.worker.lifecycle.staging import EXTRAS_HINT
from tidal.worker.lifecycle.uploads import ChunkClaim, Upload, Uploads
from tidal.worker.memory.provider import memory_provider
from tidal.worker.memory.regions import free_cached_device_memory
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

log = logging.getLogger(__name__)

# How long past its read deadline a stage may take to notice it and return before it is given up on.
_STAGE_GRACE_S = 5.0


class LifecycleManager:
    def __init__(
        self, config: LifecycleConfig, metrics: LifecycleMetrics | None = None, rank: int = 0, world_size: int = 1
    ) -> None:
        """`rank`, `world_size`: this worker's place in its group (the engine config's, which builds the model's
        expert slots from them)."""
        self.config = config
        self.metrics = metrics
        self.uploads = Uploads(config.upload_dir)
        self.group = GroupMembership(rank, world_size)
        if metrics is not None:
            metrics.set_group_size(world_size)
        self.engine: AsyncEngine | None = None
        self.expert_group: ExpertGroup | None = None  # with expert parallelism, once loaded
        self._newest_epoch = 0  # the newest epoch asked for, joined or not
        self.residency: Residency | None = None
        self._checksum: WeightsChecksum | None = None
        self._sleep_pending = False
        self._op_lock = asyncio.Lock()
        self._operation: str | None = None
        self._last_request_at: float | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ----- loading (blocking, on the loader thread) -----
    def load_engine(self, engine_config: EngineConfig) -> AsyncEngine:
        """Build the engine with its weights and KV cache in releasable memory (CUDA virtual memory where
        `stable_device_memory` asks for it and the driver offers it), and bind the lifecycle to those regions."""
        if torch.cuda.is_available():
            # Long-lived small tensors (rotary caches) must not be carved out of big cached blocks left by earlier
            # work: they would pin those whole segments through every sleep (measured: ~4 GiB on an H200).
            free_cached_device_memory(torch.device("cuda"))
        memory = memory_provider(stable_addresses=self.config.stable_device_memory)
        llm = LLMEngine.from_config(engine_config, memory)
        residency = Residency(llm, engine_config.model_path, self.config.weights_version)
        residency.read_timeout_s = self.config.checkpoint_read_timeout_s
        residency.settle.timeout_s = self.config.sleep_settle_timeout_s
        weights_path = self.config.weights_path
        if weights_path is not None and weights_path.resolve() != engine_config.model_path.resolve():
            residency.load_initial(weights_path)
        model = llm.runner.model
        if isinstance(model, MoeDecoderForCausalLM) and model.expert_parallel is not None:
            engine: AsyncEngine = self._join_expert_parallel(llm, residency, model)
        else:
            engine = AsyncEngine(llm)
        residency.engine = engine
        engine.set_admission_gate(self.admit)
        self.residency, self.engine = residency, engine
        self._publish_state()
        return engine

    def _join_expert_parallel(
        self, llm: LLMEngine, residency: Residency, model: MoeDecoderForCausalLM
    ) -> LockstepAsyncEngine:
        """The lockstep engine and the group endpoint of a rank whose model spreads its experts over the group.
        It serves nothing until the operator's first epoch is installed (`/group/reconfigure`)."""
        endpoint = GroupEndpoint(self.config.group_host, self.config.group_port)
        engine = LockstepAsyncEngine(llm, GroupLink(self.config.group_idle_poll_s), residency.version)
        residency.on_version_installed = engine.set_weights_version
        self.expert_group = ExpertGroup(
            self.group.rank, endpoint, engine, model, llm.runner.device, self.config.group_timeout_s,
            self.config.group_backend,
            checkpoint_dir=lambda: residency.version_source, on_installed=lambda _: residency.refresh_expert_slots(),
        )  # fmt: skip
        metrics = self.metrics
        if metrics is not None:
            metrics.set_group_health(GroupHealth.WAITING)

            def on_change(serving: bool) -> None:
                metrics.set_group_health(GroupHealth.SERVING if serving else GroupHealth.BROKEN)
                if not serving:
                    metrics.record_group_break()

            engine.link.on_change = on_change
        log.info("expert parallelism: rank %d of %d, group endpoint %s, %d expert slots", self.group.rank,
                 self.group.world_size, endpoint.address, len(self.expert_group.experts.slots))  # fmt: skip
        return engine

    # ----- queries -----
    @property
    def is_loaded(self) -> bool:
        return self.engine is not None and self.residency is not None

    @property
    def version(self) -> str | None:
        return self.residency.version if self.residency is not None else None

    def state(self) -> WorkerState:
        r = self.residency
        in_flight = 0
        if self.engine is not None:
            stats = self.engine.stats()
            in_flight = stats.num_running + stats.num_waiting
        level = r.sleep_level if r is not None else None
        since = None if self._last_request_at is None else time.monotonic() - self._last_request_at
        return WorkerState(
            sleep_state=SleepState.ASLEEP if level is not None else SleepState.AWAKE,
            sleep_level=level,  # type: ignore[arg-type]
            resident=r.resident if r is not None else [],
            weights_version=self.version,
            weights_source=str(r.version_source) if r is not None and r.version_source is not None else None,
            model_loaded=self.is_loaded,
            rank=self.group.rank,
            world_size=self.group.world_size,
            group_epoch=self.group.epoch,
            coordinator_rank=self.group.coordinator_rank,
            group_formed=self.group.is_formed,
            group=self.group_status(),
            in_flight_requests=in_flight,
            seconds_since_last_request=since,
        )

    # ----- group membership -----
    async def reconfigure(self, request: GroupReconfigureRequest) -> GroupReconfigureResult:
        """Apply the group's membership for an epoch. Without expert parallelism it is only recorded; with it the
        rank joins the epoch's process group and installs its expert map first (`ExpertGroup`), while the old
        epoch, if healthy, keeps serving. A newer epoch arriving meanwhile wins: the older one is refused."""
        try:
            if not self.group.check(request):  # a retry of the epoch applied: answered, and counted, as applied
                if self.metrics is not None:
                    self.metrics.record_reconfigure(self.group.epoch)
                return GroupReconfigureResult(
                    applied=False, expert_map=self._expert_map_json(), state=self.state()
                )  # fmt: skip
            outcome = None
            if self.expert_group is not None:
                self._newest_epoch = max(self._newest_epoch, request.epoch)
                outcome = await self.expert_group.join(request, self.group.group_size_of(request))
                if request.epoch < self._newest_epoch:
                    raise StaleEpochError(f"epoch {request.epoch} was overtaken by epoch {self._newest_epoch}")
            elif self.group.world_size > 1 and not self.is_loaded:
                raise NotLoadedError("the model is not loaded yet: the group's epochs start once it is")
            self.group.commit(request)
        except LifecycleError:
            if self.metrics is not None:
                self.metrics.record_reconfigure(None)
            raise
        if self.metrics is not None:
            self.metrics.record_reconfigure(self.group.epoch)
            self.metrics.set_group_size(self.group.group_size)
        ranks = sorted(m.rank for m in request.members)
        log.info("group epoch %d: members %s of a group of %d, coordinator %d, formed=%s", request.epoch, ranks,
                 self.group.group_size, request.coordinator_rank, self.group.is_formed)  # fmt: skip
        if outcome is None:
            return GroupReconfigureResult(applied=True, state=self.state())
        self._checksum = None  # the experts held, and so the tensors hashed, may have changed
        if self.metrics is not None:
            self.metrics.record_group_epoch(len(outcome.loaded_experts))
        return GroupReconfigureResult(
            applied=True, expert_map=outcome.expert_map.to_json(), loaded_experts=list(outcome.loaded_experts),
            duration_s=outcome.duration_s, state=self.state(),
        )  # fmt: skip

    def _expert_map_json(self) -> dict[str, object] | None:
        return self.expert_group.experts.expert_map.to_json() if self.expert_group is not None else None

    def group_status(self) -> GroupStatus:
        current = self.group.current
        if self.expert_group is not None:
            return self.expert_group.status(self.group.group_size, current.ranks if current is not None else [])
        health = GroupHealth.SOLO
        return GroupStatus(
            health=health, members=current.ranks if current is not None else [], group_size=self.group.group_size
        )

    # ----- requests while asleep (the engine's admission gate) -----
    async def admit(self) -> None:
        self._last_request_at = time.monotonic()
        if not self._is_asleep() and not self._sleep_pending:
            return
        if self.config.asleep_requests == "reject":
            raise self._asleep_error()
        async with self._op_lock:  # wake on demand, after whatever operation runs now
            if self._is_asleep():
                self._checksum = None
                try:
                    await self._wake(self._loaded(), ALL_TAGS)
                except Exception as err:
                    # The reason names files and control routes: it is for the logs, not for the client.
                    log.warning("a request could not wake the model: %s: %s", type(err).__name__, err)
                    raise EngineNotRunningError(
                        "the model is asleep and could not be woken; try again later", "asleep",
                        retry_after_s=self.config.asleep_retry_after_s,
                    ) from err  # fmt: skip

    def _is_asleep(self) -> bool:
        return self.residency is not None and self.residency.sleep_level is not None

    def _asleep_error(self) -> EngineNotRunningError:
        # Clients see this (a 503 with Retry-After): how the model is woken (the control API) is not theirs to know.
        return EngineNotRunningError(
            "the model is asleep; try again later", code="asleep", retry_after_s=self.config.asleep_retry_after_s
        )

    # ----- operations -----
    def _loaded(self) -> Residency:
        if self.residency is None or self.engine is None:
            raise NotLoadedError("the model is not loaded yet")
        return self.residency

    @contextlib.asynccontextmanager
    async def _exclusive(self, operation: str) -> AsyncIterator[Residency]:
        residency = self._loaded()
        if self._op_lock.locked():
            raise BusyError(f"another operation ({self._operation or 'wake on demand'}) is running; try again later")
        async with self._op_lock:
            self._operation = operation
            try:
                yield residency
            finally:
                self._operation = None

    async def _timed(self, operation: str, fn: Callable[..., int], *args: object) -> tuple[int, float]:
        return await self._measured(operation, lambda: asyncio.to_thread(fn, *args))

    async def _measured(self, operation: str, run: Callable[[], Awaitable[int]]) -> tuple[int, float]:
        start = time.monotonic()
        try:
            num_bytes = await run()
        except Exception:
            if self.metrics is not None:
                self.metrics.record_failure(operation)
            raise
        finally:
            self._publish_state()
        seconds = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.record(operation, seconds, num_bytes)
        return num_bytes, seconds

    async def sleep(self, request: SleepRequest) -> TransitionResult:
        async with self._exclusive("sleep") as r:
            self._sleep_pending = True
            try:
                num_bytes, seconds = await self._timed(
                    "sleep", r.sleep, request.level, request.mode, request.drain_timeout_s
                )
            finally:
                self._sleep_pending = False
            self._after_sleep()
            return TransitionResult(state=self.state(), duration_s=seconds, bytes_moved=num_bytes)

    def _after_sleep(self) -> None:
        """Requests that were queued while the sleep started must not wait for a wake nobody asked for."""
        assert self.engine is not None
        if self.config.asleep_requests == "reject":
            self.engine.fail_queued(self._asleep_error())
        elif self.engine.stats().num_waiting:
            self._in_background(self._wake_for_queued())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._background.discard)

    async def _wake_for_queued(self) -> None:
        """Wake for the requests queued as the sleep began (asleep_requests=wake); if the model cannot wake, they
        end with the reason rather than wait for a wake nobody asked for."""
        try:
            await self.admit()
        except EngineNotRunningError as err:
            if self.engine is not None:
                self.engine.fail_queued(err)

    async def wake_up(self, request: WakeUpRequest) -> TransitionResult:
        async with self._exclusive("wake_up") as r:
            tags = tuple(request.tags) if request.tags else ALL_TAGS
            self._checksum = None  # weights re-read from their directory may differ from what was hashed
            num_bytes, seconds = await self._wake(r, tags)
            return TransitionResult(state=self.state(), duration_s=seconds, bytes_moved=num_bytes)

    async def _wake(self, r: Residency, tags: tuple[ResidentTag, ...]) -> tuple[int, float]:
        """Wake what `tags` name. Weights dropped by a level-2 sleep are re-read from disk first, the way an update is
        staged (`_stage`): past the read deadline the wake fails (409 weights_unavailable), still asleep, and the
        worker is free again; a read still blocked in the kernel keeps host-buffer operations refused meanwhile."""

        async def run() -> int:
            if not r.needs_reload(tags):
                return await asyncio.to_thread(r.wake, tags)
            start = time.monotonic()
            stage = functools.partial(r.reload_served_version, r.read_deadline())
            try:
                reloaded = (await self._stage(r, stage)).num_bytes
            except CheckpointRejectedError as err:  # the stage's deadline; the reload's own errors are converted
                raise r.reload_failed(err.problems) from err
            return reloaded + await asyncio.to_thread(r.wake, tags, time.monotonic() - start)

        return await self._measured("wake_up", run)

    async def update_from_disk(self, request: WeightsUpdateRequest) -> WeightsUpdateResult:
        async with self._exclusive("update") as r:
            source = Path(request.source)
            stage = functools.partial(r.stage_from_disk, source, request.allow_extra_tensors, r.read_deadline())
            return await self._update(r, stage, request.version, source, request.mode, request.drain_timeout_s)

    async def stream_start(self, allow_extra_tensors: bool) -> Upload:
        self._loaded()
        return await asyncio.to_thread(self.uploads.start, allow_extra_tensors)

    @contextlib.asynccontextmanager
    async def stream_chunk_arriving(self, upload_id: str, file_name: str, offset: int) -> AsyncIterator[ChunkClaim]:
        """For a chunk whose body is still to be read: refuses it at once as its write would (unknown upload, bad file
        name or offset), or as busy while another chunk of the file arrives; else holds the file for it until the
        block ends. Write the chunk with `stream_chunk(..., claim)` inside the block."""
        begin = asyncio.ensure_future(asyncio.to_thread(self.uploads.begin_chunk, upload_id, file_name, offset))
        try:
            claim = await asyncio.shield(begin)
        except asyncio.CancelledError:
            # Cancelled while the claim's thread waits for the uploads' lock (a write in progress): the thread runs
            # on and claims the file, for a chunk that will never come; every later chunk of the file would be busy.
            self._in_background(self._give_back_claim(begin))
            raise
        try:
            yield claim
        finally:
            # Shielded: a request cancelled here must still free its file (the lock may wait for another write).
            await asyncio.shield(asyncio.to_thread(self.uploads.end_chunk, claim))

    async def _give_back_claim(self, begin: asyncio.Future[ChunkClaim]) -> None:
        with contextlib.suppress(Exception):  # refused: nothing was claimed
            claim = await begin
            await asyncio.to_thread(self.uploads.end_chunk, claim)

    async def stream_chunk(
        self, upload_id: str, file_name: str, offset: int, data: bytes | bytearray, claim: ChunkClaim | None = None
    ) -> Upload:
        return await asyncio.to_thread(self.uploads.write_chunk, upload_id, file_name, offset, data, claim)

    async def stream_finish(self, upload_id: str, request: StreamFinishRequest) -> WeightsUpdateResult:
        async with self._exclusive("update") as r:
            upload = self.uploads.finish(upload_id)
            kept = False
            try:
                stage = functools.partial(
                    r.stage_from_disk, upload.directory, upload.allow_extra_tensors, r.read_deadline()
                )
                # The spooled files are removed after: a level-2 sleep cannot re-read this version from disk.
                return await self._update(r, stage, request.version, None, request.mode, request.drain_timeout_s)
            except DrainTimeoutError:
                kept = self.uploads.reattach(upload)  # the error invites a retry of this finish
                raise
            finally:
                if not kept:
                    await asyncio.to_thread(self.uploads.remove, upload)

    async def stream_discard(self, upload_id: str) -> None:
        await asyncio.to_thread(self.uploads.discard, upload_id)

    async def update_collective(self, request: CollectiveUpdateRequest) -> WeightsUpdateResult:
        async with self._exclusive("update") as r:
            candidate = {t.name: Candidate(tuple(t.shape), t.dtype) for t in request.tensors}
            expected = plan_expected(r.expected, r.fp8_scales, {t.name: t.dtype for t in request.tensors})
            problems = find_problems(
                expected, candidate, allow_extra=request.allow_extra_tensors, is_ignored=r.is_ignored,
                extras_hint=EXTRAS_HINT,
            )  # fmt: skip
            if len(candidate) != len(request.tensors):
                problems.append("a tensor name is announced twice")
            # An extra is received into a buffer of its announced size: one no model tensor could need is refused,
            # rather than allocated (or found too large for torch) after the trainer's group was joined.
            oversized = [
                t.name
                for t in request.tensors
                if math.prod(t.shape) * getattr(torch, t.dtype).itemsize > r.weights.nbytes
            ]
            if oversized:
                problems.append(f"tensors larger than all the model's weights together: {some_of(oversized)}")
            if problems:  # refused before joining the trainer's group
                raise CheckpointRejectedError(problems)
            stage = functools.partial(r.stage_from_group, request)
            return await self._update(r, stage, request.version, None, request.mode, request.drain_timeout_s)

    async def checksum(self, recompute: bool = False) -> WeightsChecksum:
        async with self._exclusive("checksum") as r:
            if recompute or self._checksum is None or self._checksum.version != r.version:
                self._checksum = self._with_coverage(await asyncio.to_thread(r.checksum))
            return self._checksum

    def _with_coverage(self, checksum: WeightsChecksum) -> WeightsChecksum:
        """Say which experts a rank's checksum covers, so that the ranks of a group can be checked to serve one
        version (equal dense tensors; every expert's tensors equal wherever a copy is held)."""
        if self.expert_group is None:
            return checksum
        held = sorted(e for e in self.expert_group.experts.slots if e is not None)
        return checksum.model_copy(update={"covers_experts": held})

    async def _update(
        self,
        r: Residency,
        stage: Callable[[], LoadReport],
        version: str,
        source: Path | None,
        mode: DrainMode,
        drain_timeout_s: float,
    ) -> WeightsUpdateResult:
        start = time.monotonic()
        try:
            report = await self._stage(r, stage)
            paused_s = await asyncio.to_thread(r.apply_staged, version, mode, drain_timeout_s)
        except Exception:  # the served copy was not written (see Residency._staging_target): its checksum holds
            if self.metrics is not None:
                self.metrics.record_failure("update")
            raise
        r.version, r.version_source, self._checksum = version, source, None
        if isinstance(self.engine, LockstepAsyncEngine):  # also when asleep: the version it wakes with
            self.engine.set_weights_version(version)
        seconds = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.record("update", seconds, report.num_bytes)
        self._publish_state()
        log.info("now serving weights %s (%.2fs, serving held %.2fs)", version, seconds, paused_s)
        checksum_start = time.monotonic()
        self._checksum = self._with_coverage(await asyncio.to_thread(r.checksum))
        return WeightsUpdateResult(
            version=version, checksum=self._checksum.overall, duration_s=seconds, bytes_loaded=report.num_bytes,
            paused_s=paused_s, checksum_s=time.monotonic() - checksum_start,
        )  # fmt: skip

    async def _stage(self, r: Residency, stage: Callable[[], LoadReport]) -> LoadReport:
        """Run `stage` (an update's, or a level-2 wake's re-read) on a thread; with a read deadline, give up on it
        shortly after (a header read blocked in the kernel is not bounded by the reader's own deadline): the operation
        fails and the worker is free, while the thread, until it returns, keeps host-buffer operations refused
        (StrayReads)."""
        returned = threading.Event()

        def run() -> LoadReport:
            try:
                return stage()
            finally:
                returned.set()

        task = asyncio.ensure_future(asyncio.to_thread(run))
        limit = None if r.read_timeout_s is None else r.read_timeout_s + _STAGE_GRACE_S
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            r.stray_reads.add(returned)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is this one, reported
            raise CheckpointRejectedError([f"reading the checkpoint did not finish in {r.read_timeout_s:g}s"])
        return task.result()

    def _publish_state(self) -> None:
        if self.metrics is not None:
            level = self.residency.sleep_level if self.residency is not None else None
            self.metrics.set_state(level or 0, self.version)
