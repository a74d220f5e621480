"""In-place weight updates on the CPU with the tiny models: B's outputs equal transformers' with B's weights, bad
checkpoints change nothing, requests in flight finish wholly on one version, and the disk, streamed and collective
paths reach one checksum."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.contract.control_api import (
    CollectiveUpdateRequest,
    SleepRequest,
    StreamFinishRequest,
    TensorSpec,
    WakeUpRequest,
    WeightsUpdateRequest,
)
from tidal.worker.checkpoint import reader
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.lifecycle.errors import (
    BusyError,
    CheckpointRejectedError,
    CollectiveError,
    DrainTimeoutError,
    WeightsUnavailableError,
)
from tidal.worker.testing.hf_reference import prompt_ids, transformers_greedy
from tidal.worker.testing.in_process import ControlledWorker, greedy, running_manager
from tidal.worker.testing.silent_port import SilentPort
from tidal.worker.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def version_b(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("b") / "b", sharded=True, seed=7)


def test_update_to_b_gives_transformers_output_with_b(tiny_model, version_b):
    model_dir = tiny_model("llama")
    prompts = prompt_ids(model_dir)
    expected_b = transformers_greedy(version_b, prompts, 12)

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before = await greedy(manager, prompts)
            assert before != expected_b
            result = await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            assert result.version == "b" == manager.version and result.bytes_loaded > 0
            assert await greedy(manager, prompts) == expected_b
            # The prefix cache was flushed: a repeated prompt is not served from KV computed with A.
            assert await greedy(manager, prompts) == expected_b

    asyncio.run(scenario())


def _broken(source, out, change):
    """A copy of `source`'s single-file checkpoint with `change(tensors)` applied."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


NAN_TENSOR = "model.layers.1.mlp.down_proj.weight"
INF_TENSOR = "model.layers.0.self_attn.q_proj.weight"


def _poison(tensors, name, values):
    """Write `values` (NaN, +/-Inf) into the first elements of `tensors[name]`."""
    flat = tensors[name].view(-1)
    flat[: len(values)] = torch.tensor(values, dtype=flat.dtype)


@pytest.mark.parametrize(
    ("case", "change", "reason"),
    [
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors"),
        ("shape", lambda t: t.update({"model.norm.weight": torch.ones(65)}), "wrong shapes"),
        ("dtype", lambda t: t.update({"lm_head.weight": t["lm_head.weight"].half()}), "wrong dtypes"),
        ("extra", lambda t: t.update({"model.extra.weight": torch.ones(3)}), "does not have"),
        ("nan", lambda t: _poison(t, NAN_TENSOR, [float("nan")]), f"{NAN_TENSOR}: 1 non-finite value (NaN or Inf)"),
        (
            "inf",
            lambda t: _poison(t, INF_TENSOR, [float("inf"), -float("inf")]),
            f"{INF_TENSOR}: 2 non-finite values (NaN or Inf)",
        ),
    ],
)
def test_a_bad_checkpoint_changes_nothing(tiny_model, version_b, tmp_path, case, change, reason):
    model_dir = tiny_model("llama")
    with ControlledWorker(model_path=model_dir, num_kv_blocks=64) as worker:
        before_text, before_sum = worker.text("Hello"), worker.checksum()
        bad = _broken(model_dir, tmp_path / case, change)
        response = worker.post("/weights/update", {"source": str(bad), "version": "broken"})
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["code"] == "bad_checkpoint" and reason in body["message"] and "nothing changed" in body["message"]
        assert worker.checksum() == before_sum and worker.text("Hello") == before_text
        assert worker.control.get("/state").json()["weights_version"] == "base"  # type: ignore[union-attr]
        if case == "extra":  # allowed on request: the extra tensor is skipped
            ok = worker.post("/weights/update", {"source": str(bad), "version": "x", "allow_extra_tensors": True})
            assert ok.status_code == 200 and ok.json()["checksum"] == before_sum["overall"]


def test_truncated_file_is_rejected_before_anything_is_read(tiny_model, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    data = (tiny_model("llama") / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 100])

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            with pytest.raises(CheckpointRejectedError, match="past the end"):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(bad), version="t"))
            assert manager.version == "a"

    asyncio.run(scenario())


def _many_bad_entries(directory):
    header = json.dumps({f"t{i}": {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 1]} for i in range(20_000)})
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0")


def _many_missing_shards(directory):
    weight_map = {f"t{i}": f"shard-{i:05d}.safetensors" for i in range(20_000)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _a_long_name(directory):
    save_file({"x" * 2_000_000: torch.zeros(1)}, directory / "model.safetensors")


@pytest.mark.parametrize("write", [_many_bad_entries, _many_missing_shards, _a_long_name])
def test_a_checkpoint_with_countless_problems_is_refused_with_a_short_message(tiny_model, tmp_path, write):
    # The message goes into the answer, the logs and the operator's status: it names a few problems, not megabytes.
    write(tmp_path)

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            with pytest.raises(CheckpointRejectedError) as err:
                await manager.update_from_disk(WeightsUpdateRequest(source=str(tmp_path), version="x"))
            assert len(err.value.message) < 20_000 and manager.version == "a"

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_requests_during_an_update_finish_wholly_on_one_version(tiny_model, version_b, mode):
    model_dir = tiny_model("llama")
    prompt, n = "The tide comes in", 120
    with ControlledWorker(model_path=model_dir, num_kv_blocks=512) as worker:
        text_a = worker.text(prompt, n)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            before = [pool.submit(worker.complete, prompt, n) for _ in range(4)]
            _wait_for_in_flight(worker, 4)
            update = pool.submit(
                worker.post, "/weights/update", {"source": str(version_b), "version": "b", "mode": mode}
            )
            time.sleep(0.05)
            during = [pool.submit(worker.complete, prompt, n) for _ in range(3)]  # held, then served by B
            assert update.result().status_code == 200
            text_b = worker.text(prompt, n)
            assert text_a != text_b
            for future in before:
                response = future.result()
                if mode == "drain":
                    assert response.json()["choices"][0]["text"] == text_a
                else:
                    assert response.status_code == 503 and "version b" in response.json()["error"]["message"]
            for future in during:
                assert future.result().json()["choices"][0]["text"] == text_b


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])  # fp8: each path quantizes as the disk path does
def test_streamed_and_collective_updates_reach_the_disk_checksum(tiny_model, version_b, tmp_path, weight_dtype):
    model_dir = tiny_model("llama")
    with ControlledWorker(model_path=model_dir, num_kv_blocks=64, weight_dtype=weight_dtype) as worker:
        assert any(n.endswith(".weight_scale") for n in worker.checksum()["tensors"]) == (weight_dtype == "fp8")
        disk = worker.post("/weights/update", {"source": str(version_b), "version": "b"}).json()["checksum"]
        text_b = worker.text("Hello")
        worker.post("/weights/update", {"source": str(model_dir), "version": "a"})

        # Streamed: every shard and the index, in chunks of 50 kB.
        upload_id = worker.post("/weights/stream/start").json()["upload_id"]
        for path in sorted(version_b.glob("model*")):
            data = path.read_bytes()
            for offset in range(0, len(data), 50_000):
                chunk = worker.control.post(  # type: ignore[union-attr]
                    f"/weights/stream/{upload_id}/chunk", params={"file": path.name, "offset": offset},
                    content=data[offset : offset + 50_000],
                )  # fmt: skip
                assert chunk.status_code == 200, chunk.text
            again = worker.control.post(  # type: ignore[union-attr]
                f"/weights/stream/{upload_id}/chunk", params={"file": path.name, "offset": 0}, content=b"x"
            )
            assert again.status_code == 409 and again.json()["code"] == "bad_offset"
        finished = worker.post(f"/weights/stream/{upload_id}/finish", {"version": "b-streamed"})
        assert finished.status_code == 200 and finished.json()["checksum"] == disk
        assert worker.text("Hello") == text_b
        worker.post("/weights/update", {"source": str(model_dir), "version": "a"})

        # Collective: a trainer process broadcasts B's tensors over gloo.
        tensors = {}
        for path in sorted(version_b.glob("*.safetensors")):
            tensors.update(load_file(path))
        response, body = _broadcast_update(worker, version_b, tensors, "b-broadcast")
        assert response.status_code == 200, response.text
        assert response.json()["checksum"] == disk
        assert worker.text("Hello") == text_b
        bad = worker.post("/weights/collective", {**body, "tensors": body["tensors"][:-1]})
        assert bad.status_code == 422 and "missing tensors" in bad.json()["message"]


def _broadcast_update(
    worker: ControlledWorker, source: Path, tensors: dict[str, torch.Tensor], version: str
) -> tuple[Any, dict[str, Any]]:
    """A collective update (gloo) from a trainer process that broadcasts `source`'s tensors, of the shapes in
    `tensors`; -> (the worker's answer, the request body). The trainer must end cleanly whatever the worker says."""
    names = sorted(tensors)
    specs = [{"name": n, "shape": list(tensors[n].shape), "dtype": "float32"} for n in names]
    port = _free_port()
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(source), str(port), json.dumps(names)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank": 1, "world_size": 2,
                "backend": "gloo", "tensors": specs, "version": version, "timeout_s": 60}  # fmt: skip
        response = worker.post("/weights/collective", body)
        assert trainer.wait(timeout=60) == 0, trainer.stdout.read()  # type: ignore[union-attr]
    finally:
        trainer.kill()
    return response, body


_TRAINER = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from tidal.worker.lifecycle.collective import send_weights
tensors = {}
for path in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    tensors.update(load_file(path))
send_weights("127.0.0.1", int(sys.argv[2]), 2, [(n, tensors[n]) for n in json.loads(sys.argv[3])], timeout_s=60)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_in_flight(worker: ControlledWorker, n: int) -> None:
    deadline = time.monotonic() + 30
    while worker.control.get("/state").json()["in_flight_requests"] < n:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_streamed_update_that_times_out_draining_can_be_finished_again(tiny_model, version_b):
    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            assert manager.engine is not None
            upload = await manager.stream_start(False)
            for path in sorted(version_b.glob("model*")):
                await manager.stream_chunk(upload.upload_id, path.name, 0, path.read_bytes())
            params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            running = manager.engine.generate("long", [5, 6, 7], params)
            await anext(running)
            # The error says "retry": the uploaded files must still be there for that retry.
            with pytest.raises(DrainTimeoutError, match="retry"):
                await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="b", drain_timeout_s=0.05))
            assert manager.version == "a"
            finished = await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="b", mode="abort"))
            assert finished.version == "b" and manager.version == "b"
            assert not upload.directory.exists()
            await running.aclose()

    asyncio.run(scenario())


def test_a_finish_while_a_chunk_is_written_is_busy_at_once_and_the_loop_goes_on(tiny_model, version_b):
    # The event loop serves the OpenAI API too: a finish must not wait on it for another call's hold on the uploads,
    # a chunk's write, which lasts as long as the spool volume takes (for good, if it stalls).
    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            upload = await manager.stream_start(False)
            for path in sorted(version_b.glob("model*")):
                await manager.stream_chunk(upload.upload_id, path.name, 0, path.read_bytes())
            writing, written = threading.Event(), threading.Event()

            def write_slowly() -> None:
                with manager.uploads._lock:  # a chunk's write in progress
                    writing.set()
                    written.wait(2.0)

            writer = threading.Thread(target=write_slowly)
            writer.start()
            writing.wait()
            start = time.monotonic()
            try:
                with pytest.raises(BusyError, match="being written"):
                    await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="b"))
                assert time.monotonic() - start < 1.0 and manager.version == "a"
            finally:
                written.set()
                writer.join()
            finished = await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="b"))
            assert finished.version == "b" == manager.version and not upload.directory.exists()

    asyncio.run(scenario())


def test_a_fifo_for_weights_is_refused_without_blocking(tiny_model, tmp_path):
    source = tmp_path / "fifo"
    source.mkdir()
    os.mkfifo(source / "model.safetensors")  # opening it to read would wait for a writer forever

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            with pytest.raises(CheckpointRejectedError, match="not a regular file"):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(source), version="f"))
            assert manager.version == "a" and manager.state().weights_version == "a"

    asyncio.run(scenario())


def test_a_stalled_read_fails_the_update_in_time_and_frees_the_worker(tiny_model, version_b, monkeypatch):
    unblock = threading.Event()
    real_read = reader._read_fully

    def stalled(fd: int, offset: int, buf: memoryview) -> int:
        unblock.wait()  # a stalled network file system: the read cannot be interrupted
        return real_read(fd, offset, buf)

    async def scenario() -> None:
        async with running_manager(tiny_model("llama"), checkpoint_read_timeout_s=0.5) as manager:
            before = await manager.checksum()
            monkeypatch.setattr(reader, "_read_fully", stalled)
            start = time.monotonic()
            with pytest.raises(CheckpointRejectedError, match="did not finish in time"):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            assert time.monotonic() - start < 10 and manager.version == "a"
            # Not busy; but the host buffer may still be written by the blocked read, so what uses it waits.
            with pytest.raises(WeightsUnavailableError, match="still blocked"):
                await manager.sleep(SleepRequest(level=1))
            unblock.set()  # the read returns at last; once its threads end, the host buffer is the worker's again
            deadline = time.monotonic() + 10
            while True:
                try:
                    await manager.checksum(recompute=True)
                    break
                except WeightsUnavailableError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            assert (await manager.checksum(recompute=True)).overall == before.overall
            monkeypatch.setattr(reader, "_read_fully", real_read)
            result = await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            assert result.version == "b" == manager.version

    asyncio.run(scenario())


def test_a_silent_trainer_fails_the_collective_update_in_time_and_frees_the_worker(tiny_model, version_b):
    tensors = {}
    for path in sorted(version_b.glob("*.safetensors")):
        tensors.update(load_file(path))
    specs = [TensorSpec(name=n, shape=list(t.shape), dtype="float32") for n, t in sorted(tensors.items())]

    async def scenario(silent: SilentPort) -> None:
        # A short read deadline: a join that ignores its own timeout runs into the stage's give-up (422, then 409
        # until the worker restarts) in seconds rather than hanging the test.
        async with running_manager(tiny_model("llama"), checkpoint_read_timeout_s=2.0) as manager:
            try:
                before = await manager.checksum()
                request = CollectiveUpdateRequest(
                    master_address="127.0.0.1", master_port=silent.port, rank=1, world_size=2, tensors=specs,
                    version="b", timeout_s=1.0,
                )  # fmt: skip
                start = time.monotonic()
                with pytest.raises(CollectiveError, match="its rendezvous did not answer within 1s"):
                    await manager.update_collective(request)
                assert time.monotonic() - start < 4.0 and manager.version == "a"
                assert (await manager.checksum(recompute=True)).overall == before.overall
                # Nothing of the join outlived it: another update is accepted at once, not refused as unavailable.
                result = await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
                assert result.version == "b" == manager.version
            finally:
                silent.close()  # a join still blocked on it (the bug) returns, so that the test can end

    with SilentPort() as silent:
        asyncio.run(scenario(silent))


@pytest.mark.parametrize("shape", [[2**31, 2**31, 4], [2**40]])  # too large for torch to size, or to hold
def test_an_announced_extra_too_large_for_any_model_is_refused_before_joining(tiny_model, version_b, shape):
    tensors = {}
    for path in sorted(version_b.glob("*.safetensors")):
        tensors.update(load_file(path))
    specs = [TensorSpec(name=n, shape=list(t.shape), dtype="float32") for n, t in sorted(tensors.items())]

    async def scenario() -> None:
        async with running_manager(tiny_model("llama")) as manager:
            request = CollectiveUpdateRequest(
                master_address="127.0.0.1", master_port=_free_port(), rank=1, world_size=2, version="x",
                tensors=[TensorSpec(name="extra.huge", shape=shape, dtype="float32"), *specs],
                allow_extra_tensors=True, timeout_s=5.0,
            )  # fmt: skip
            # Refused before the (absent) trainer is called: else a 500 once its group is joined, or host memory gone.
            with pytest.raises(CheckpointRejectedError, match=r"larger than all the model's weights.*extra\.huge"):
                await manager.update_collective(request)
            assert manager.version == "a"

    asyncio.run(scenario())


@pytest.mark.parametrize("level", [1, 2])
def test_an_update_while_asleep_is_what_the_wake_serves(tiny_model, version_b, level):
    # What the operator relies on to wake a rank on new weights: the update is staged while asleep, and the wake
    # brings back B without serving or (level 2) re-reading A first.
    model_dir = tiny_model("llama")
    prompts = prompt_ids(model_dir)
    expected_b = transformers_greedy(version_b, prompts, 12)

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            await manager.sleep(SleepRequest(level=level))
            await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            state = manager.state()
            assert state.sleep_state == "asleep" and state.weights_version == "b"
            assert state.weights_source == str(version_b)
            await manager.wake_up(WakeUpRequest())
            assert manager.residency is not None and "reload from disk" not in manager.residency.last_wake_phases
            assert await greedy(manager, prompts) == expected_b

    asyncio.run(scenario())


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])  # fp8: the values are checked before they are quantized
def test_non_finite_weights_are_refused_on_every_path_and_the_old_ones_serve(
    tiny_model, version_b, tmp_path, weight_dtype
):
    model_dir = tiny_model("llama")
    tensors = {}
    for path in sorted(version_b.glob("*.safetensors")):
        tensors.update(load_file(path))
    _poison(tensors, NAN_TENSOR, [float("nan")] * 3)
    _poison(tensors, INF_TENSOR, [float("inf")])
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors")
    reasons = [f"{NAN_TENSOR}: 3 non-finite values (NaN or Inf)", f"{INF_TENSOR}: 1 non-finite value (NaN or Inf)"]

    with ControlledWorker(model_path=model_dir, num_kv_blocks=64, weight_dtype=weight_dtype) as worker:
        before_text, before_sum = worker.text("Hello"), worker.checksum()

        def assert_refused_and_unchanged(response) -> None:
            assert response.status_code == 422, response.text
            body = response.json()
            assert body["code"] == "bad_checkpoint" and "nothing changed" in body["message"], body
            assert all(reason in body["message"] for reason in reasons), body["message"]
            assert worker.checksum() == before_sum and worker.text("Hello") == before_text
            assert worker.control.get("/state").json()["weights_version"] == "base"  # type: ignore[union-attr]

        # From a directory.
        assert_refused_and_unchanged(worker.post("/weights/update", {"source": str(bad), "version": "nan"}))

        # Streamed: the file in one chunk.
        upload_id = worker.post("/weights/stream/start").json()["upload_id"]
        data = (bad / "model.safetensors").read_bytes()
        chunk = worker.control.post(  # type: ignore[union-attr]
            f"/weights/stream/{upload_id}/chunk", params={"file": "model.safetensors", "offset": 0}, content=data
        )
        assert chunk.status_code == 200, chunk.text
        assert_refused_and_unchanged(worker.post(f"/weights/stream/{upload_id}/finish", {"version": "nan"}))

        # Collective: the trainer broadcasts the poisoned tensors; the worker receives them all, then refuses.
        assert_refused_and_unchanged(_broadcast_update(worker, bad, tensors, "nan")[0])

        # The worker is not left busy or unable: a good update goes through.
        assert worker.post("/weights/update", {"source": str(version_b), "version": "b"}).status_code == 200


def test_non_finite_weights_staged_while_asleep_leave_the_old_ones_to_wake(tiny_model, version_b, tmp_path):
    # Asleep at level 1 the host buffer is the only copy of the served weights: the refused update must not touch it.
    model_dir = tiny_model("llama")
    prompts = prompt_ids(model_dir)
    bad = _broken(model_dir, tmp_path / "nan", lambda t: _poison(t, NAN_TENSOR, [float("nan")]))

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before, before_sum = await greedy(manager, prompts), await manager.checksum()
            await manager.sleep(SleepRequest(level=1))
            with pytest.raises(CheckpointRejectedError, match=f"{NAN_TENSOR}: 1 non-finite value"):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(bad), version="nan"))
            assert manager.version == "a"
            await manager.wake_up(WakeUpRequest())
            assert (await manager.checksum(recompute=True)).overall == before_sum.overall
            assert await greedy(manager, prompts) == before

    asyncio.run(scenario())
