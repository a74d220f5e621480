"""What of the model is on the device, and the blocking moves between those states.

The engine allocated its weights and KV cache in releasable regions (tidal.worker.memory); this class releases and
restores them, and keeps the weights' host buffer of the same layout (`resident`).
`_host_valid` says whether that buffer holds exactly the served weights. Every update stages the whole new
checkpoint in the buffer after checking all of it, while the old weights keep serving (asleep at level 1, where the
buffer is the served copy, through a spare buffer); only then are new requests held, running ones drained or
interrupted, the buffer copied to the device in place and the prefix cache flushed.
Each method blocks (copies, file reads, a collective): the manager calls them off the event loop, one at a time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tidal.contract.control_api import CollectiveUpdateRequest, DrainMode, ResidentTag, WeightsChecksum
from tidal.worker.checkpoint.directory import stored_tensors
from tidal.worker.checkpoint.errors import CheckpointError, ReadTimeoutError, summary
from tidal.worker.checkpoint.fp8_targets import Destination, QuantizeInto, fp8_weight_scales, plan_destinations
from tidal.worker.checkpoint.header import StoredTensor, dtype_name
from tidal.worker.checkpoint.judge import Expected
from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.checkpoint.values import FiniteCheck
from tidal.worker.engine.async_engine import AsyncEngine
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.lifecycle import collective
from tidal.worker.lifecycle.checksum import overall_digest, weights_digests
from tidal.worker.lifecycle.errors import (
    CheckpointRejectedError,
    DrainTimeoutError,
    HostMemoryError,
    WeightsUnavailableError,
)
from tidal.worker.lifecycle.kv_fill import KVFill
from tidal.worker.lifecycle.release_settle import ReleaseSettle
from tidal.worker.lifecycle.resident import ResidentWeights
from tidal.worker.lifecycle.staging import check_directory, spare_host_buffer, stage_tensors
from tidal.worker.lifecycle.stray_reads import StrayReads
from tidal.worker.memory.regions import free_cached_device_memory

log = logging.getLogger(__name__)

ALL_TAGS = (ResidentTag.WEIGHTS, ResidentTag.KV_CACHE)


class Residency:
    def __init__(self, llm: LLMEngine, model_path: Path, version: str) -> None:
        """Act on `llm`'s memory: its weights' and KV cache's regions, as the engine allocated them."""
        runner = llm.runner
        if runner.kv_cache_region is None:
            raise RuntimeError("the engine has no KV cache")
        self.llm = llm
        self.weights = ResidentWeights(runner.model, runner.weights_region)
        self.kv = runner.kv_cache_region
        self._model_path = model_path
        self.expected = expected_tensors(self.weights, model_path)
        self.engine: AsyncEngine | None = None  # set by the manager once the engine exists
        self.version = version
        self.version_source: Path | None = model_path  # where the served version can be re-read (None: not on disk)
        self.sleep_level: int | None = None
        self._host_valid = False
        self.last_wake_phases: dict[str, float] = {}  # seconds of each part of the last wake, for the logs
        self.kv_fill = KVFill(self.kv, lambda: self._engine().between_steps())
        # Told the version now on the device, inside the quiesced switch (a lockstep group steps on one version).
        self.on_version_installed: Callable[[str], None] | None = None
        self.read_timeout_s: float | None = None  # a checkpoint read's deadline (LifecycleConfig)
        self.stray_reads = StrayReads()
        # After a sleep's release, wait for the driver to finish clearing the memory (release_settle says why).
        self.settle = ReleaseSettle(self.weights.host, self.weights.device)

    def load_initial(self, weights_path: Path) -> None:
        """Serve `weights_path` instead of the model directory's weights (before the engine starts)."""
        report = self.stage_from_disk(weights_path, allow_extra=False)
        self.weights.to_device()
        self._host_valid = True
        self.version_source = weights_path
        log.info("initial weights from %s (%.2f GiB)", weights_path, report.num_bytes / 2**30)

    @property
    def resident(self) -> list[ResidentTag]:
        flags = (self.weights.is_resident, self.kv.is_resident)
        return [tag for tag, is_resident in zip(ALL_TAGS, flags, strict=True) if is_resident]

    def is_ignored(self, name: str) -> bool:
        return self.llm.runner.model.ignored_checkpoint_tensor(name)

    # ----- sleep and wake -----
    def sleep(self, level: int, mode: DrainMode, timeout_s: float) -> int:
        """-> bytes copied or freed."""
        self.stray_reads.check("sleep")
        self.kv_fill.join()  # the KV region must not be released while the rest of it is being mapped
        if self.sleep_level is not None and level <= self.sleep_level and not self.resident:
            return 0  # already as deep asleep, and nothing was woken since (a wake may restore a part only)
        held_here = self.sleep_level is None
        if held_here:
            self._hold(mode, timeout_s, f"the worker goes to sleep (level {level})")
        num_bytes = 0
        try:
            with self._quiesced() as llm:
                if level == 1:  # a level-2 wake re-reads the disk first, which outlasts the clearing
                    self.settle.take_reference()
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
                free_cached_device_memory(self.weights.device)  # the last steps' activations: cleared with the rest
                if self.settle.wait() > 0:
                    free_cached_device_memory(self.weights.device)  # the probe's buffer
                    log.info("sleep: the device was quiet again %.3fs after the release", self.settle.last_wait_s)
        except BaseException:
            self.settle.discard()  # the probe's buffer, if the failure came between its reference and its wait
            if held_here and self.weights.is_resident and self.kv.is_resident:
                self._engine().release()  # nothing was released: serve on rather than hold requests for good
            elif held_here:
                self.sleep_level = level  # partly released: asleep, and a wake restores the rest
            raise
        self.sleep_level = level
        return num_bytes

    def wake(self, tags: tuple[ResidentTag, ...], reloaded_s: float | None = None) -> int:
        """Restore what `tags` name; serving resumes once weights and KV cache are both back. -> bytes copied.
        The KV cache comes back in two steps: its first share before serving resumes, the rest right after, on a
        thread, joining the block pool when it is all mapped (`kv_fill`). `reloaded_s`: how long re-reading the
        weights took, when the caller did it just before (`needs_reload`), for the wake's phases."""
        if self.sleep_level is None:
            return 0
        self.stray_reads.check("wake up")
        num_bytes = 0
        phases = self.last_wake_phases = {} if reloaded_s is None else {"reload from disk": reloaded_s}
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name] = now - mark
            mark = now

        if self.needs_reload(tags):  # never read inside the quiesced section: the caller re-reads under a deadline
            raise RuntimeError("weights dropped by a level-2 sleep must be re-read (reload_served_version) first")
        with self._quiesced() as llm:
            lap("hold")
            if ResidentTag.WEIGHTS in tags and not self.weights.is_resident:
                self.weights.restore()
                lap("map weights")
                num_bytes += self.weights.to_device(wait=False)
                lap("queue weights copy")
            if ResidentTag.KV_CACHE in tags and not self.kv.is_resident:
                self.kv.restore()  # maps while the weights copy runs
                lap("map KV first share")
            self.weights.synchronize()
            lap("wait for the copy")
            if not (self.weights.is_resident and self.kv.is_resident):
                return num_bytes  # still asleep: serving needs both
            llm.runner.recapture_graphs_if_moved()  # torch storage on CUDA may come back elsewhere
            llm.block_manager.set_num_usable(self.kv.usable_blocks)
            lap("block pool")
        self.sleep_level = None
        self._engine().release()
        self.kv_fill.start()
        lap("resume")
        log.info("wake phases (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        return num_bytes

    def needs_reload(self, tags: tuple[ResidentTag, ...]) -> bool:
        """Whether waking `tags` must first re-read the served version from disk (its weights were dropped by a
        level-2 sleep). The manager does that before `wake`, as an update's stage, so that a read that never returns
        is given up on at its deadline instead of holding the operation lock and the engine's step lock for good."""
        return (
            self.sleep_level is not None
            and ResidentTag.WEIGHTS in tags
            and not self.weights.is_resident
            and not self._host_valid
        )

    def reload_served_version(self, deadline: float | None = None) -> LoadReport:
        """Read the served version back into the host buffer from its directory, by `deadline` (see StrayReads for a
        read blocked past it). WeightsUnavailableError if it did not come from a directory or cannot be read."""
        self.stray_reads.check("wake up")
        if self.version_source is None:
            raise WeightsUnavailableError(
                f"the weights of version {self.version} were dropped by a level-2 sleep and did not come from a "
                "directory (streamed or broadcast); send a weight update before waking the weights"
            )
        log.info("reloading version %s from %s after a level-2 sleep", self.version, self.version_source)
        try:
            return self.stage_from_disk(self.version_source, allow_extra=True, deadline=deadline)
        except CheckpointRejectedError as err:
            raise self.reload_failed(err.problems) from err

    def reload_failed(self, problems: list[str]) -> WeightsUnavailableError:
        """The refusal of a wake whose re-read of the served version failed or passed its deadline: still asleep."""
        return WeightsUnavailableError(
            f"the weights of version {self.version}, dropped by a level-2 sleep, could not be re-read from "
            f"{self.version_source}: {summary(problems)}; still asleep, nothing changed"
        )

    # ----- weight updates: stage (checked, into the host buffer), then apply -----
    def read_deadline(self) -> float | None:
        return None if self.read_timeout_s is None else time.monotonic() + self.read_timeout_s

    def stage_from_disk(self, source: Path, allow_extra: bool, deadline: float | None = None) -> LoadReport:
        """Check the whole checkpoint, then read it into the host buffer (the served weights stay untouched).
        `deadline` (time.monotonic()): the reads' (see StrayReads for one that is blocked past it)."""
        self.stray_reads.check("stage an update")
        scales = self.fp8_scales  # once: the check and the reads must plan from the same names
        tensors = check_directory(source, self.expected, allow_extra, self.is_ignored, scales)
        if deadline is not None and time.monotonic() > deadline:
            # The caller gave up while the headers were read; nothing may be written now.
            raise CheckpointRejectedError(["reading the checkpoint's headers did not finish in time"])
        with self._staging_target() as views:
            try:
                return stage_tensors(tensors, views, deadline, scales)
            except CheckpointRejectedError as err:
                if isinstance(err.__cause__, ReadTimeoutError):
                    self.stray_reads.add(err.__cause__.settled)
                raise

    def stage_from_group(self, request: CollectiveUpdateRequest) -> LoadReport:
        """Receive a trainer's broadcast into the host buffer (the request's specs were checked already)."""
        self.stray_reads.check("stage an update")
        start = time.monotonic()
        with self._staging_target() as views:
            num_bytes = self._receive_broadcast(request, views)
        return LoadReport(len(request.tensors), num_bytes, time.monotonic() - start)

    def _receive_broadcast(self, request: CollectiveUpdateRequest, views: dict[str, torch.Tensor]) -> int:
        """-> bytes received. Every tensor is received (the trainer's broadcasts must all be matched) before one
        holding NaN or Inf refuses the update (CheckpointRejectedError naming each), as a checkpoint's would."""
        received: list[tuple[str, torch.Tensor]] = []  # the model's tensors received in their served dtype
        converted: list[tuple[str, Destination, torch.Tensor]] = []
        # An FP8 weight sent in a float dtype (its scale not sent) is quantized into its view and its scale's.
        planned = plan_destinations(views, self.fp8_scales, {spec.name: spec.dtype for spec in request.tensors})

        def destinations() -> Iterator[tuple[str, torch.Tensor]]:
            for spec in request.tensors:
                dtype = getattr(torch, spec.dtype)
                view = planned.get(spec.name)
                if isinstance(view, torch.Tensor) and view.dtype == dtype:
                    received.append((spec.name, view))
                    yield spec.name, view
                    continue
                scratch = torch.empty(spec.shape, dtype=dtype)  # an extra, or a dtype converted afterwards
                if view is not None:
                    converted.append((spec.name, view, scratch))
                yield spec.name, scratch

        group = collective.join_group(
            request.master_address, request.master_port, request.rank, request.world_size, request.backend,
            request.timeout_s,
        )  # fmt: skip
        on = self.weights.device if request.backend == "nccl" else torch.device("cpu")
        try:
            num_bytes = collective.receive_into(group, destinations(), on)
        finally:
            collective.leave_group(group)
        finite = FiniteCheck()
        for name, view in received:
            finite.add(name, view)
        for name, dest, scratch in converted:
            if isinstance(dest, QuantizeInto):
                finite.add(name, scratch)  # as sent: quantizing would turn a NaN or an Inf into a scale's
                dest.write_rows(0, scratch)
            else:
                dest.copy_(scratch)
                finite.add(name, dest, scratch.dtype)
        problems = finite.problems()
        if problems:  # raised inside the staging target: what was staged is dropped, the served copy untouched
            raise CheckpointRejectedError(problems)
        return num_bytes

    @contextlib.contextmanager
    def _staging_target(self) -> Iterator[dict[str, torch.Tensor]]:
        """The views an update is staged into; what they hold counts only if the body ends without an exception.

        Usually the host buffer itself: the device copy serves meanwhile (awake), or nothing served is in the buffer
        (level 2). Asleep at level 1 the buffer is the only copy of the served weights, so the update goes into a
        spare buffer, allocated for this update only, and is copied over the host buffer once all of it arrived: a
        transfer that breaks half way (a read error, a trainer gone mid-broadcast) leaves the old weights whole.
        Without room for the spare, a served version that came from a directory is given up instead, as a level-2
        sleep would: the update goes into the buffer, and if it breaks, the wake re-reads the old version. Refusing
        would leave a model that wakes on new weights no way but to serve the old ones until it is updated awake.
        """
        if not (self._host_valid and not self.weights.is_resident):
            yield from self._stage_into_host_buffer()
            return
        try:
            spare, views = spare_host_buffer(self.weights.slots, self.weights.nbytes)
        except HostMemoryError:
            if self.version_source is None:
                raise  # streamed or broadcast: the host buffer is the only copy there is
            log.info(
                "no room for a spare host buffer: version %s is re-read from disk if this update fails", self.version
            )
            yield from self._stage_into_host_buffer()
            return
        yield views
        # One host copy keeps the (pinned, allocated once) host buffer and the views into it; the spare is freed.
        self.weights.host.copy_(spare)

    def _stage_into_host_buffer(self) -> Iterator[dict[str, torch.Tensor]]:
        self._host_valid = False  # from here on the buffer is overwritten
        yield self.weights.host_views()
        self._host_valid = not self.weights.is_resident  # asleep: the buffer now holds the staged version

    def apply_staged(self, version: str, mode: DrainMode, drain_timeout_s: float) -> float:
        """Copy the staged buffer over the served weights, between requests. -> seconds serving was held."""
        if not self.weights.is_resident:
            return 0.0  # asleep: the staged buffer is what a wake brings back
        start = time.monotonic()
        held_here = self.sleep_level is None
        if held_here:
            self._hold(mode, drain_timeout_s, f"the worker switches its weights to version {version}")
        try:
            with self._quiesced() as llm:
                self.weights.to_device()
                llm.reset_prefix_cache()  # its KV was computed with the old weights
                if self.on_version_installed is not None:
                    self.on_version_installed(version)
            self._host_valid = True
        finally:
            if held_here:
                self._engine().release()
        return time.monotonic() - start

    @property
    def fp8_scales(self) -> dict[str, str]:
        """Served FP8 weights -> their scales' names: an update may give such a weight in a float dtype (quantized
        on staging). From the current slots, since an expert-parallel epoch changes which experts' names are
        served here."""
        return fp8_weight_scales(self.weights.slots)

    def refresh_expert_slots(self) -> None:
        """The experts this rank holds changed (a new epoch's map, installed on the loop thread): the checkpoint
        names map to other slots now, and the host buffer no longer mirrors the device."""
        self.weights.refresh_slots()
        self.expected = expected_tensors(self.weights, self.version_source or self._model_path)
        self._host_valid = False

    def checksum(self) -> WeightsChecksum:
        self.stray_reads.check("compute the checksum")
        if self.weights.is_resident and not self._host_valid:
            # One fast copy into the (idle) host buffer beats many small device reads from the hashing threads.
            self.weights.to_host()
            self._host_valid = True
        if not self._host_valid:
            raise WeightsUnavailableError("the weights were dropped by a level-2 sleep: nothing to checksum")
        digests = weights_digests(self.weights.host_views())
        return WeightsChecksum(version=self.version, overall=overall_digest(digests), tensors=digests)

    # ----- the engine between steps -----
    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise RuntimeError("the engine is not bound")
        return self.engine

    def _hold(self, mode: DrainMode, timeout_s: float, why: str) -> None:
        interrupt = f"request ended: {why}" if mode == DrainMode.ABORT else None
        if not self._engine().hold(timeout_s, interrupt):
            raise DrainTimeoutError(
                f"requests were still running after {timeout_s:g}s, so nothing changed ({why}); "
                "retry, raise drain_timeout_s, or use mode 'abort'"
            )

    @contextlib.contextmanager
    def _quiesced(self) -> Iterator[LLMEngine]:
        with self._engine().quiesced() as llm:
            yield llm


def expected_tensors(weights: ResidentWeights, model_path: Path) -> dict[str, Expected]:
    """Each served tensor accepts its live dtype and the dtype the model's own checkpoint stores it in."""
    stored: dict[str, StoredTensor] = {}
    with contextlib.suppress(CheckpointError):
        stored = stored_tensors(model_path)
    out = {}
    for name, slot in weights.slots.items():
        dtypes = {dtype_name(slot.dtype)}
        if name in stored:
            dtypes.add(stored[name].dtype_name)
        out[name] = Expected(slot.shape, frozenset(dtypes))
    return out
