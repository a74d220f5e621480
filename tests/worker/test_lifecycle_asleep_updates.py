"""Weight updates that break half way while the model sleeps at level 1, when the host buffer holds the only copy
of the served weights: whatever the path (streamed, broadcast, disk), the old version keeps its weights, its
checksum and its outputs, and the wake brings it back without re-reading anything.

The served version is a streamed one (it cannot be re-read from a directory), so weights lost by the failed update
could not be recovered by the wake and the tests would see it."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tidal.contract.control_api import (
    CollectiveUpdateRequest,
    SleepRequest,
    StreamFinishRequest,
    WakeUpRequest,
    WeightsUpdateRequest,
)
from tidal.worker.checkpoint import reader
from tidal.worker.lifecycle import staging
from tidal.worker.lifecycle.errors import CheckpointRejectedError, CollectiveError, HostMemoryError
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.testing.in_process import greedy, running_manager
from tidal.worker.testing.tiny_models import write_tiny_model

PROMPTS = [[5, 6, 7, 8], [11, 3, 9]]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """The checkpoint the tests serve (streamed in, so not re-readable from disk)."""
    return write_tiny_model("llama", tmp_path_factory.mktemp("served") / "s", sharded=True, seed=21)


@pytest.fixture(scope="module")
def incoming(tmp_path_factory) -> Path:
    """The checkpoint of the update that fails."""
    return write_tiny_model("llama", tmp_path_factory.mktemp("incoming") / "c", seed=22)


async def _stream(manager: LifecycleManager, checkpoint: Path, version: str) -> None:
    upload = await manager.stream_start(False)
    for path in sorted(checkpoint.glob("model*")):
        await manager.stream_chunk(upload.upload_id, path.name, 0, path.read_bytes())
    await manager.stream_finish(upload.upload_id, StreamFinishRequest(version=version))


def _files_shrink_once_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each checkpoint file loses its second half between the header check and the read (a file rewritten in
    place, a spool disk failing): the real read then fails part way, after the first tensors were written."""
    read_into = reader.read_into

    def shrink_then_read(jobs, num_threads=None, deadline=None):  # type: ignore[no-untyped-def]
        for path in {tensor.path for tensor, _ in jobs}:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return read_into(jobs, num_threads, deadline)

    monkeypatch.setattr(reader, "read_into", shrink_then_read)


async def _asleep_serving(manager: LifecycleManager, served: Path) -> tuple[list[list[int]], str]:
    """Serve `served` (streamed), sleep at level 1. -> its greedy outputs and checksum."""
    await _stream(manager, served, "s")
    outputs, checksum = await greedy(manager, PROMPTS), (await manager.checksum()).overall
    await manager.sleep(SleepRequest(level=1))
    return outputs, checksum


async def _still_serves(manager: LifecycleManager, outputs: list[list[int]], checksum: str) -> None:
    """Asleep: same version and checksum (recomputed from the host buffer); awake: same outputs, nothing re-read."""
    assert manager.version == "s" and manager.state().sleep_level == 1
    assert (await manager.checksum(recompute=True)).overall == checksum
    woke = await manager.wake_up(WakeUpRequest())
    assert woke.state.sleep_state == "awake" and woke.state.weights_version == "s"
    assert await greedy(manager, PROMPTS) == outputs
    assert (await manager.checksum(recompute=True)).overall == checksum


def test_a_streamed_update_failing_part_way_while_asleep_loses_nothing(tiny_model, served, incoming, monkeypatch):
    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            outputs, checksum = await _asleep_serving(manager, served)
            upload = await manager.stream_start(False)
            data = (incoming / "model.safetensors").read_bytes()
            await manager.stream_chunk(upload.upload_id, "model.safetensors", 0, data)
            _files_shrink_once_checked(monkeypatch)
            with pytest.raises(CheckpointRejectedError, match=r"part way.*end of file"):
                await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="c"))
            monkeypatch.undo()
            await _still_serves(manager, outputs, checksum)

    asyncio.run(scenario())


def test_a_disk_update_from_a_truncated_or_shrinking_file_while_asleep_loses_nothing(
    tiny_model, served, incoming, tmp_path, monkeypatch
):
    truncated, shrinking = tmp_path / "truncated", tmp_path / "shrinking"
    shutil.copytree(incoming, truncated)
    shutil.copytree(incoming, shrinking)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            outputs, checksum = await _asleep_serving(manager, served)
            with pytest.raises(CheckpointRejectedError, match="past the end"):  # refused before any write
                await manager.update_from_disk(WeightsUpdateRequest(source=str(truncated), version="c"))
            _files_shrink_once_checked(monkeypatch)
            with pytest.raises(CheckpointRejectedError, match="part way"):  # fails after some writes
                await manager.update_from_disk(WeightsUpdateRequest(source=str(shrinking), version="c"))
            monkeypatch.undo()
            await _still_serves(manager, outputs, checksum)
            # The spare buffer is for failures only: a good update while asleep is what the wake brings back.
            await manager.sleep(SleepRequest(level=1))
            await manager.update_from_disk(WeightsUpdateRequest(source=str(incoming), version="c"))
            assert manager.version == "c"
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, PROMPTS) != outputs

    asyncio.run(scenario())


def test_a_broadcast_whose_trainer_dies_part_way_while_asleep_loses_nothing(tiny_model, served, incoming):
    tensors = load_file(incoming / "model.safetensors")
    names = sorted(tensors)
    specs = [{"name": n, "shape": list(tensors[n].shape), "dtype": "float32"} for n in names]
    port = _free_port()

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            outputs, checksum = await _asleep_serving(manager, served)
            trainer = subprocess.Popen(
                [sys.executable, "-c", _DYING_TRAINER, str(incoming), str(port), json.dumps(names)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            try:
                body = {"master_address": "127.0.0.1", "master_port": port, "rank": 1, "world_size": 2}
                request = CollectiveUpdateRequest(**body, tensors=specs, version="c", timeout_s=60)
                with pytest.raises(CollectiveError, match="receiving"):
                    await manager.update_collective(request)
                assert trainer.wait(timeout=60) == 3, trainer.stdout.read()  # type: ignore[union-attr]
            finally:
                trainer.kill()
            await _still_serves(manager, outputs, checksum)

    asyncio.run(scenario())


# Sends the first half of the tensors, then dies without leaving the group.
_DYING_TRAINER = """
import json, os, sys
from pathlib import Path
from safetensors.torch import load_file
from tidal.worker.lifecycle.collective import send_weights
tensors = load_file(Path(sys.argv[1]) / "model.safetensors")
names = json.loads(sys.argv[3])
send_weights("127.0.0.1", int(sys.argv[2]), 2, [(n, tensors[n]) for n in names[: len(names) // 2]], timeout_s=60)
os._exit(3)
"""


def _no_room_for_a_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.worker.lifecycle import residency

    monkeypatch.setattr(residency, "spare_host_buffer", lambda slots, _: staging.spare_host_buffer(slots, 2**62))


def test_no_room_for_a_spare_buffer_refuses_an_update_over_weights_only_the_host_holds(
    tiny_model, served, incoming, monkeypatch
):
    with pytest.raises(HostMemoryError, match="could not be allocated"):  # the real allocator refuses 4 EiB
        staging.spare_host_buffer({}, 2**62)

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            outputs, checksum = await _asleep_serving(manager, served)  # streamed: nowhere to re-read it from
            _no_room_for_a_spare(monkeypatch)
            with pytest.raises(HostMemoryError, match="wake the model first") as err:
                await manager.update_from_disk(WeightsUpdateRequest(source=str(incoming), version="c"))
            monkeypatch.undo()
            assert err.value.code == "no_host_memory"
            await _still_serves(manager, outputs, checksum)

    asyncio.run(scenario())


def test_no_room_for_a_spare_buffer_gives_up_a_host_copy_that_disk_holds_too(
    tiny_model, incoming, tmp_path, monkeypatch
):
    # Served from a directory, the old weights can be read again: the update takes the host buffer, and one that
    # breaks part way leaves the wake to re-read the old version, as after a level-2 sleep.
    model_dir = tiny_model("llama")
    shrinking = tmp_path / "shrinking"
    shutil.copytree(incoming, shrinking)

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            outputs = await greedy(manager, PROMPTS)
            await manager.sleep(SleepRequest(level=1))
            _no_room_for_a_spare(monkeypatch)
            with pytest.MonkeyPatch.context() as shrink:
                _files_shrink_once_checked(shrink)
                with pytest.raises(CheckpointRejectedError, match="part way"):
                    await manager.update_from_disk(WeightsUpdateRequest(source=str(shrinking), version="c"))
            assert manager.version == "a"
            await manager.wake_up(WakeUpRequest())
            assert manager.residency is not None and "reload from disk" in manager.residency.last_wake_phases
            assert await greedy(manager, PROMPTS) == outputs
            await manager.sleep(SleepRequest(level=1))
            await manager.update_from_disk(WeightsUpdateRequest(source=str(incoming), version="c"))
            await manager.wake_up(WakeUpRequest())
            assert manager.version == "c" and "reload from disk" not in manager.residency.last_wake_phases
            assert await greedy(manager, PROMPTS) != outputs

    asyncio.run(scenario())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
