"""The worker's lifecycle: sleep and wake, in-place weight updates and checksums, one operation at a time.

Weights and KV cache live in releasable regions (`resident`), and the weights have a host buffer of the same layout.
Every update stages the whole new checkpoint in that buffer after checking all of it (names, shapes, dtypes, file
sizes), while the old weights keep serving; only then are new requests held, running ones drained or interrupted, the
buffer copied to the device in place and the prefix cache flushed. So a bad checkpoint changes nothing, addresses never
move, and every request runs wholly on one version. The blocking work runs on worker threads; the asyncio side only
orders operations (a second one while one runs is refused as busy).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import torch

from tidal.worker.control.schema import (
    CollectiveUpdateRequest,
    DrainMode,
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
from tidal.worker.engine.async_engine import AsyncEngine, EngineNotRunningError
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.lifecycle import collective
from tidal.worker.lifecycle.checksum import overall_digest, weights_digests
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.lifecycle.device_memory import allocate_region
from tidal.worker.lifecycle.errors import (
    BusyError,
    CheckpointRejectedError,
    DrainTimeoutError,
    NotLoadedError,
    WeightsUnavailableError,
)
from tidal.worker.lifecycle.metrics import LifecycleMetrics
from tidal.worker.lifecycle.resident import ResidentKVCache, ResidentWeights, free_cached_device_memory
from tidal.worker.lifecycle.staging import StageReport, check_file_tensors, checkpoint_tensors, stage_file_tensors
from tidal.worker.lifecycle.uploads import Upload, Uploads
from tidal.worker.lifecycle.validation import Candidate, Expected, find_problems

log = logging.getLogger(__name__)

ALL_TAGS = (ResidentTag.WEIGHTS, ResidentTag.KV_CACHE)


class LifecycleManager:
    def __init__(self, config: LifecycleConfig, metrics: LifecycleMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.uploads = Uploads(config.upload_dir)
        self.engine: AsyncEngine | None = None
        self.weights: ResidentWeights | None = None
        self.kv: ResidentKVCache | None = None
        self._llm: LLMEngine | None = None
        self._expected: dict[str, Expected] = {}
        self._version: str | None = None
        self._version_source: Path | None = None  # where the served version can be re-read from (None: not on disk)
        self._host_valid = False  # the host buffer holds exactly the served version
        self._sleep_level: int | None = None
        self._sleep_pending = False
        self._graph_addresses: tuple[int, int] | None = None  # (weights, KV) region addresses the graphs captured
        self._checksum: WeightsChecksum | None = None
        self._op_lock = asyncio.Lock()
        self._operation: str | None = None
        self._last_request_at: float | None = None

    # ----- loading (blocking, on the loader thread) -----
    def load_engine(self, engine_config: EngineConfig) -> AsyncEngine:
        """Build the engine, move its weights and KV cache into releasable memory, capture CUDA graphs there."""
        if torch.cuda.is_available():
            # Long-lived small tensors (rotary caches) must not be carved out of big cached blocks left by earlier
            # work: they would pin those whole segments through every sleep (measured: ~4 GiB on an H200).
            torch.cuda.empty_cache()
        llm = LLMEngine.from_config(engine_config.model_copy(update={"enforce_eager": True}))
        self.attach(llm, engine_config.model_path, capture_graphs=not engine_config.enforce_eager)
        engine = AsyncEngine(llm)
        self.bind(engine)
        return engine

    def attach(self, llm: LLMEngine, model_path: Path, capture_graphs: bool = False) -> None:
        runner = llm.runner
        make_region = functools.partial(allocate_region, prefer_stable=self.config.stable_device_memory)
        runner.decode_graphs = None
        kv_runner_cache = runner.kv_caches
        runner.kv_caches = []  # the weights move first, into the room the KV cache leaves
        del kv_runner_cache
        free_cached_device_memory(runner.device, collect=True)
        self.weights = ResidentWeights(runner.model, runner.device, make_region)
        self.kv = ResidentKVCache(runner, make_region)
        self._llm = llm
        self._expected = self._expected_tensors(model_path)
        source = self.config.weights_path or model_path
        if self.config.weights_path is not None and self.config.weights_path.resolve() != model_path.resolve():
            report = self._stage_from_disk(self.config.weights_path, allow_extra=False)
            self.weights.to_device()
            log.info("initial weights from %s (%.2f GiB)", self.config.weights_path, report.num_bytes / 2**30)
        self._version, self._version_source = self.config.weights_version, source
        if capture_graphs and runner.device.type == "cuda":
            runner.capture_cuda_graphs(llm.config.max_num_seqs, llm.max_model_len)
            self._graph_addresses = self._region_addresses()
        self._publish_state()

    def bind(self, engine: AsyncEngine) -> None:
        self.engine = engine
        engine.set_admission_gate(self.admit)

    def _expected_tensors(self, model_path: Path) -> dict[str, Expected]:
        """Each served tensor accepts its live dtype and the dtype the model's own checkpoint stores it in."""
        assert self.weights is not None
        stored: dict[str, str] = {}
        with contextlib.suppress(CheckpointRejectedError):
            stored = {t.name: t.dtype_name for t in checkpoint_tensors(model_path)}
        out = {}
        for name, slot in self.weights.slots.items():
            dtypes = {str(slot.dtype).removeprefix("torch.")}
            if name in stored:
                dtypes.add(stored[name])
            out[name] = Expected(slot.shape, frozenset(dtypes))
        return out

    # ----- queries -----
    @property
    def is_loaded(self) -> bool:
        return self.engine is not None and self.weights is not None

    @property
    def version(self) -> str | None:
        return self._version

    def state(self) -> WorkerState:
        resident: list[ResidentTag] = []
        in_flight = 0
        if self.is_loaded:
            assert self.weights is not None and self.kv is not None and self.engine is not None
            resident = [t for t, r in zip(ALL_TAGS, (self.weights.is_resident, self.kv.is_resident), strict=True) if r]
            stats = self.engine.stats()
            in_flight = stats.num_running + stats.num_waiting
        since = None if self._last_request_at is None else time.monotonic() - self._last_request_at
        return WorkerState(
            sleep_state=SleepState.ASLEEP if self._sleep_level is not None else SleepState.AWAKE,
            sleep_level=self._sleep_level,  # type: ignore[arg-type]
            resident=resident,
            weights_version=self._version,
            model_loaded=self.is_loaded,
            rank=self.config.rank,
            world_size=self.config.world_size,
            group_epoch=0,
            leader_rank=0,
            group_formed=self.config.world_size == 1,
            in_flight_requests=in_flight,
            seconds_since_last_request=since,
        )

    # ----- requests while asleep (the engine's admission gate) -----
    async def admit(self) -> None:
        self._last_request_at = time.monotonic()
        if self._sleep_level is None and not self._sleep_pending:
            return
        if self.config.asleep_requests == "reject":
            raise self._asleep_error()
        async with self._op_lock:  # wake on demand, after whatever operation runs now
            if self._sleep_level is not None:
                try:
                    await self._timed("wake_up", self._wake_blocking, ALL_TAGS)
                except Exception as err:
                    raise EngineNotRunningError(f"the model is asleep and could not be woken: {err}", "asleep") from err

    def _asleep_error(self) -> EngineNotRunningError:
        return EngineNotRunningError(
            f"the model is asleep (level {self._sleep_level or 'pending'}); it serves again after POST /wake_up",
            code="asleep",
            retry_after_s=self.config.retry_after_s,
        )

    # ----- operations -----
    @contextlib.asynccontextmanager
    async def _exclusive(self, operation: str) -> AsyncIterator[None]:
        if not self.is_loaded:
            raise NotLoadedError("the model is not loaded yet")
        if self._op_lock.locked():
            raise BusyError(f"another operation ({self._operation or 'wake on demand'}) is running; try again later")
        async with self._op_lock:
            self._operation = operation
            try:
                yield
            finally:
                self._operation = None

    async def _timed(self, operation: str, fn: Callable[..., int], *args: object) -> tuple[int, float]:
        start = time.monotonic()
        try:
            num_bytes = await asyncio.to_thread(fn, *args)
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
        async with self._exclusive("sleep"):
            self._sleep_pending = True
            try:
                num_bytes, seconds = await self._timed(
                    "sleep", self._sleep_blocking, request.level, request.mode, request.drain_timeout_s
                )
            finally:
                self._sleep_pending = False
            self._after_sleep()
            return TransitionResult(state=self.state(), duration_s=seconds, bytes_moved=num_bytes)

    async def wake_up(self, request: WakeUpRequest) -> TransitionResult:
        async with self._exclusive("wake_up"):
            tags = tuple(request.tags) if request.tags else ALL_TAGS
            num_bytes, seconds = await self._timed("wake_up", self._wake_blocking, tags)
            return TransitionResult(state=self.state(), duration_s=seconds, bytes_moved=num_bytes)

    async def update_from_disk(self, request: WeightsUpdateRequest) -> WeightsUpdateResult:
        async with self._exclusive("update"):
            source = Path(request.source)
            stage = functools.partial(self._stage_from_disk, source, request.allow_extra_tensors)
            return await self._update(stage, request.version, source, request.mode, request.drain_timeout_s)

    async def stream_start(self, allow_extra_tensors: bool) -> Upload:
        if not self.is_loaded:
            raise NotLoadedError("the model is not loaded yet")
        return await asyncio.to_thread(self.uploads.start, "", allow_extra_tensors)

    async def stream_chunk(self, upload_id: str, file_name: str, offset: int, data: bytes) -> Upload:
        return await asyncio.to_thread(self.uploads.write_chunk, upload_id, file_name, offset, data)

    async def stream_finish(self, upload_id: str, request: StreamFinishRequest) -> WeightsUpdateResult:
        async with self._exclusive("update"):
            upload = self.uploads.finish(upload_id)
            try:
                stage = functools.partial(self._stage_from_disk, upload.directory, upload.allow_extra_tensors)
                # The spooled files are removed after: a level-2 sleep cannot re-read this version from disk.
                return await self._update(stage, request.version, None, request.mode, request.drain_timeout_s)
            finally:
                await asyncio.to_thread(self.uploads.remove, upload)

    async def stream_discard(self, upload_id: str) -> None:
        await asyncio.to_thread(self.uploads.discard, upload_id)

    async def update_collective(self, request: CollectiveUpdateRequest) -> WeightsUpdateResult:
        async with self._exclusive("update"):
            candidate = {t.name: Candidate(tuple(t.shape), t.dtype) for t in request.tensors}
            problems = find_problems(self._expected, candidate, request.allow_extra_tensors, self._is_ignored)
            if len(candidate) != len(request.tensors):
                problems.append("a tensor name is announced twice")
            if problems:
                raise CheckpointRejectedError(problems)
            stage = functools.partial(self._stage_from_group, request)
            return await self._update(stage, request.version, None, request.mode, request.drain_timeout_s)

    async def checksum(self, recompute: bool = False) -> WeightsChecksum:
        async with self._exclusive("checksum"):
            if recompute or self._checksum is None or self._checksum.version != self._version:
                self._checksum = await asyncio.to_thread(self._checksum_blocking)
            return self._checksum

    # ----- the blocking parts -----
    def _hold(self, mode: DrainMode, timeout_s: float, why: str) -> None:
        assert self.engine is not None
        interrupt = f"request ended: {why}" if mode == DrainMode.ABORT else None
        if not self.engine.hold(timeout_s, interrupt):
            raise DrainTimeoutError(
                f"requests were still running after {timeout_s:g}s, so nothing changed ({why}); "
                "retry, raise drain_timeout_s, or use mode 'abort'"
            )

    def _sleep_blocking(self, level: int, mode: DrainMode, timeout_s: float) -> int:
        assert self.engine is not None and self.weights is not None and self.kv is not None
        if self._sleep_level is not None and level <= self._sleep_level:
            return 0
        if self._sleep_level is None:
            self._hold(mode, timeout_s, f"the worker goes to sleep (level {level})")
        num_bytes = 0
        with self.engine.quiesced() as llm:
            if self.weights.is_resident:
                if level == 1:
                    num_bytes += self.weights.to_host()
                    self._host_valid = True
                self.weights.release()
                num_bytes += self.weights.nbytes if level == 2 else 0
            if level == 2:
                self._host_valid = False
            if self.kv.is_resident:
                self.kv.release()
                num_bytes += self.kv.nbytes
            llm.reset_prefix_cache()
            free_cached_device_memory(self.weights.device)
        self._sleep_level = level
        return num_bytes

    def _after_sleep(self) -> None:
        """Requests that were queued while the sleep started must not wait for a wake nobody asked for."""
        assert self.engine is not None
        if self.config.asleep_requests == "reject":
            self.engine.fail_queued(self._asleep_error())
        elif self.engine.stats().num_waiting:
            asyncio.get_running_loop().create_task(self.admit())

    def _wake_blocking(self, tags: tuple[ResidentTag, ...]) -> int:
        assert self.engine is not None and self.weights is not None and self.kv is not None
        if self._sleep_level is None:
            return 0
        num_bytes = 0
        with self.engine.quiesced():
            if ResidentTag.WEIGHTS in tags and not self.weights.is_resident:
                if not self._host_valid:
                    num_bytes += self._reload_served_version()
                self.weights.restore()
                num_bytes += self.weights.to_device(wait=False)
            if ResidentTag.KV_CACHE in tags and not self.kv.is_resident:
                self.kv.restore()  # maps while the weights copy runs
            self.weights.synchronize()
            if not (self.weights.is_resident and self.kv.is_resident):
                return num_bytes  # still asleep: serving needs both
            self._recapture_graphs_if_moved()
        self._sleep_level = None
        self.engine.release()
        return num_bytes

    def _reload_served_version(self) -> int:
        if self._version_source is None:
            raise WeightsUnavailableError(
                f"the weights of version {self._version} were dropped by a level-2 sleep and did not come from a "
                "directory (streamed or broadcast); send a weight update before waking the weights"
            )
        log.info("reloading version %s from %s after a level-2 sleep", self._version, self._version_source)
        self._checksum = None  # the directory may have changed since
        return self._stage_from_disk(self._version_source, allow_extra=True).num_bytes

    def _recapture_graphs_if_moved(self) -> None:
        assert self._llm is not None
        if self._graph_addresses is None or self._graph_addresses == self._region_addresses():
            return
        start = time.monotonic()
        self._llm.runner.capture_cuda_graphs(self._llm.config.max_num_seqs, self._llm.max_model_len)
        self._graph_addresses = self._region_addresses()
        log.info("memory moved across the sleep: CUDA graphs recaptured in %.2fs", time.monotonic() - start)

    def _region_addresses(self) -> tuple[int, int]:
        assert self.weights is not None and self.kv is not None
        return self.weights.region.data_ptr(), self.kv.region.data_ptr()

    def _stage_from_disk(self, source: Path, allow_extra: bool) -> StageReport:
        """Check the whole checkpoint, then read it into the host buffer (the served weights stay untouched)."""
        assert self.weights is not None
        tensors = check_file_tensors(checkpoint_tensors(source), self._expected, allow_extra, self._is_ignored)
        self._host_valid = False  # from here on the buffer is overwritten
        report = stage_file_tensors(tensors, self.weights.host_views())
        self._host_valid = not self.weights.is_resident  # asleep: the buffer now holds the staged version
        return report

    def _stage_from_group(self, request: CollectiveUpdateRequest) -> StageReport:
        assert self.weights is not None
        start = time.monotonic()
        views = self.weights.host_views()
        converted: list[tuple[torch.Tensor, torch.Tensor]] = []

        def destinations() -> Iterator[tuple[str, torch.Tensor]]:
            for spec in request.tensors:
                dtype = getattr(torch, spec.dtype)
                view = views.get(spec.name)
                if view is not None and view.dtype == dtype:
                    yield spec.name, view
                    continue
                scratch = torch.empty(spec.shape, dtype=dtype)
                if view is not None:
                    converted.append((view, scratch))
                yield spec.name, scratch

        group = collective.join_group(
            request.master_address, request.master_port, request.rank, request.world_size, request.backend,
            request.timeout_s,
        )  # fmt: skip
        try:
            self._host_valid = False
            num_bytes = collective.receive_into(
                group, destinations(), self.weights.device if request.backend == "nccl" else torch.device("cpu")
            )
        finally:
            collective.leave_group(group)
        for view, scratch in converted:
            view.copy_(scratch)
        self._host_valid = not self.weights.is_resident
        return StageReport(len(request.tensors), num_bytes, time.monotonic() - start)

    async def _update(
        self,
        stage: Callable[[], StageReport],
        version: str,
        source: Path | None,
        mode: DrainMode,
        drain_timeout_s: float,
    ) -> WeightsUpdateResult:
        start = time.monotonic()
        try:
            report = await asyncio.to_thread(stage)
            paused_s = await asyncio.to_thread(self._apply_staged, version, mode, drain_timeout_s)
        except Exception:
            if self.metrics is not None:
                self.metrics.record_failure("update")
            raise
        self._version, self._version_source, self._checksum = version, source, None
        seconds = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.record("update", seconds, report.num_bytes)
        self._publish_state()
        log.info("now serving weights %s (%.2fs, serving held %.2fs)", version, seconds, paused_s)
        checksum_start = time.monotonic()
        self._checksum = await asyncio.to_thread(self._checksum_blocking)
        return WeightsUpdateResult(
            version=version, checksum=self._checksum.overall, duration_s=seconds, bytes_loaded=report.num_bytes,
            paused_s=paused_s, checksum_s=time.monotonic() - checksum_start,
        )  # fmt: skip

    def _apply_staged(self, version: str, mode: DrainMode, drain_timeout_s: float) -> float:
        """Copy the staged buffer over the served weights, between requests. -> seconds serving was held."""
        assert self.engine is not None and self.weights is not None
        if not self.weights.is_resident:
            return 0.0  # asleep: the staged buffer is what a wake brings back
        start = time.monotonic()
        held_here = self._sleep_level is None
        if held_here:
            self._hold(mode, drain_timeout_s, f"the worker switches its weights to version {version}")
        try:
            with self.engine.quiesced() as llm:
                self.weights.to_device()
                llm.reset_prefix_cache()  # its KV was computed with the old weights
            self._host_valid = True
        finally:
            if held_here:
                self.engine.release()
        return time.monotonic() - start

    def _checksum_blocking(self) -> WeightsChecksum:
        assert self.weights is not None
        if self.weights.is_resident and not self._host_valid:
            # One fast copy into the (idle) host buffer beats many small device reads from the hashing threads.
            self.weights.to_host()
            self._host_valid = True
        if not self._host_valid:
            raise WeightsUnavailableError("the weights were dropped by a level-2 sleep: nothing to checksum")
        tensors = self.weights.host_views()
        digests = weights_digests(tensors)
        return WeightsChecksum(version=self._version, overall=overall_digest(digests), tensors=digests)

    def _is_ignored(self, name: str) -> bool:
        assert self._llm is not None
        return self._llm.runner.model.ignored_checkpoint_tensor(name)

    def _publish_state(self) -> None:
        if self.metrics is not None:
            self.metrics.set_state(self._sleep_level or 0, self._version)
