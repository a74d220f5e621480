"""Sleep and wake on the CPU with the tiny models: identical outputs after both levels, requests while asleep,
sleep while requests run (drain and abort), metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from tidal.contract.control_api import DrainMode, SleepRequest, WakeUpRequest, WeightsUpdateRequest
from tidal.worker.engine.async_engine import EngineNotRunningError
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.lifecycle.errors import WeightsUnavailableError
from tidal.worker.testing.hf_reference import prompt_ids
from tidal.worker.testing.in_process import ControlledWorker, greedy, running_manager
from tidal.worker.testing.tiny_models import write_tiny_model


def test_outputs_identical_after_wake_from_both_levels(tiny_model):
    model_dir = tiny_model("qwen3")
    prompts = prompt_ids(model_dir)

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before = await greedy(manager, prompts)
            assert (await manager.sleep(SleepRequest(level=1))).state.resident == []
            assert manager.residency is not None and not manager.residency.weights.is_resident
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, prompts) == before
            await manager.sleep(SleepRequest(level=2))
            # Level 2 dropped the weights; an update from disk first, then the wake serves it.
            await manager.update_from_disk(WeightsUpdateRequest(source=str(model_dir), version="a2"))
            woke = await manager.wake_up(WakeUpRequest(tags=["weights"]))
            assert woke.state.sleep_state == "asleep" and woke.state.resident == ["weights"]
            woke = await manager.wake_up(WakeUpRequest(tags=["kv_cache"]))
            assert woke.state.sleep_state == "awake" and manager.version == "a2"
            assert await greedy(manager, prompts) == before
            # Level 2 then a plain wake re-reads the served version from its directory.
            await manager.sleep(SleepRequest(level=2))
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, prompts) == before

    asyncio.run(scenario())


def test_level2_wake_refuses_weights_that_cannot_be_reloaded(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    stream_dir = write_tiny_model("llama", tmp_path / "b", seed=1)

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            upload = await manager.stream_start(False)
            data = (stream_dir / "model.safetensors").read_bytes()
            await manager.stream_chunk(upload.upload_id, "model.safetensors", 0, data)
            from tidal.contract.control_api import StreamFinishRequest

            await manager.stream_finish(upload.upload_id, StreamFinishRequest(version="streamed"))
            await manager.sleep(SleepRequest(level=2))
            try:
                await manager.wake_up(WakeUpRequest())
                raise AssertionError("the wake should have been refused")
            except WeightsUnavailableError as err:
                assert "weight update" in str(err)
            assert manager.state().sleep_state == "asleep"

    asyncio.run(scenario())


def test_requests_while_asleep_get_503_with_retry_after_or_wake_the_model(tiny_model):
    model_dir = tiny_model("llama")
    with ControlledWorker(model_path=model_dir, num_kv_blocks=64) as worker:
        expected = worker.text("Hello")
        assert worker.post("/sleep", {"level": 1}).status_code == 200
        refused = worker.complete("Hello")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "30"
        assert refused.json()["error"]["code"] == "asleep"
        # A client of the OpenAI API is told to retry, not about the control API or the sleep level.
        message = refused.json()["error"]["message"]
        assert message == "the model is asleep; try again later", message
        assert worker.post("/wake_up").json()["state"]["sleep_state"] == "awake"
        assert worker.text("Hello") == expected
        metrics = worker.api.get("/metrics").text  # type: ignore[union-attr]
        assert 'tidal_lifecycle_operations_total{operation="sleep",outcome="ok"} 1.0' in metrics
        assert 'tidal_weights_version_info{version="base"} 1.0' in metrics
        assert "tidal_sleep_level 0.0" in metrics
    with ControlledWorker(model_path=model_dir, num_kv_blocks=64, asleep_requests="wake") as worker:
        assert worker.post("/sleep", {"level": 2}).status_code == 200
        assert worker.text("Hello") == expected  # woke on demand, reloading the weights from disk
        assert worker.control.get("/state").json()["sleep_state"] == "awake"  # type: ignore[union-attr]


def test_sleep_drains_running_requests_or_aborts_them_with_a_reason(tiny_model):
    model_dir = tiny_model("llama")
    with ControlledWorker(model_path=model_dir, num_kv_blocks=256) as worker:
        full = worker.text("The tide", max_tokens=200)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(worker.complete, "The tide", 200) for _ in range(3)]
            _wait_for_in_flight(worker, 3)
            slept = worker.post("/sleep", {"level": 1, "mode": DrainMode.DRAIN.value})
            assert slept.status_code == 200
            for future in running:  # drained: each finished whole before the sleep
                assert future.result().json()["choices"][0]["text"] == full
        worker.post("/wake_up")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(worker.complete, "The tide", 200) for _ in range(3)]
            _wait_for_in_flight(worker, 3)
            assert worker.post("/sleep", {"level": 1, "mode": "abort"}).status_code == 200
            for future in running:
                response = future.result()
                assert response.status_code == 503 and "goes to sleep" in response.json()["error"]["message"]
                assert response.json()["error"]["code"] == "interrupted"
        assert worker.api is not None
        metrics = worker.api.get("/metrics").text
        # The server's interruption is counted apart from clients that went away.
        assert 'tidal_requests_total{endpoint="completions",outcome="interrupted"} 3.0' in metrics
        assert 'tidal_requests_total{endpoint="completions",outcome="cancelled"} 0.0' in metrics


def _wait_for_in_flight(worker: ControlledWorker, n: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while worker.control.get("/state").json()["in_flight_requests"] < n:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_sleep_that_fails_before_releasing_anything_serves_on(tiny_model, monkeypatch):
    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before = await greedy(manager, [[5, 6, 7]])
            assert manager.residency is not None

            def broken_copy() -> int:
                raise RuntimeError("host copy failed")

            monkeypatch.setattr(manager.residency.weights, "to_host", broken_copy)
            try:
                await manager.sleep(SleepRequest(level=1))
                raise AssertionError("the sleep should have failed")
            except RuntimeError as err:
                assert "host copy failed" in str(err)
            assert manager.state().sleep_state == "awake"
            assert manager.residency.resident == ["weights", "kv_cache"]
            # Held for good before: the request below waited forever.
            assert await asyncio.wait_for(greedy(manager, [[5, 6, 7]]), 30) == before

    asyncio.run(scenario())


def test_requests_queued_as_the_sleep_began_end_when_the_wake_they_ask_for_fails(tiny_model):
    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir, asleep_requests="wake") as manager:
            engine, residency = manager.engine, manager.residency
            assert engine is not None and residency is not None
            residency.version_source = None  # as after a streamed update: a level-2 sleep cannot be undone
            assert await asyncio.to_thread(engine.hold, 10.0)  # a request arrives just as serving is held
            stream = engine.generate("queued", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
            waiting = asyncio.create_task(anext(stream))
            while engine.stats().num_waiting == 0:
                await asyncio.sleep(0.01)
            await manager.sleep(SleepRequest(level=2))
            with pytest.raises(EngineNotRunningError, match="could not be woken") as refused:
                await asyncio.wait_for(waiting, 30)
            # The reason (a level-2 sleep of streamed weights, and what to send the control API) is for the logs.
            assert "weight update" not in str(refused.value) and "level" not in str(refused.value)
            assert refused.value.retry_after_s is not None

    asyncio.run(scenario())


def test_sleeping_again_after_a_partial_wake_releases_what_the_wake_restored(tiny_model):
    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            before = await greedy(manager, [[5, 6, 7]])
            await manager.sleep(SleepRequest(level=1))
            woke = await manager.wake_up(WakeUpRequest(tags=["weights"]))
            assert woke.state.sleep_state == "asleep" and woke.state.resident == ["weights"]
            slept = await manager.sleep(SleepRequest(level=1))
            assert slept.state.resident == [] and slept.bytes_moved > 0
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, [[5, 6, 7]]) == before

    asyncio.run(scenario())


def test_a_transfer_that_fails_while_asleep_leaves_the_served_copy_and_its_checksum(tiny_model, monkeypatch):
    from tidal.worker.lifecycle import residency as residency_module

    model_dir = tiny_model("llama")

    async def scenario() -> None:
        async with running_manager(model_dir) as manager:
            served = (await manager.checksum()).overall
            await manager.sleep(SleepRequest(level=1))  # the host buffer now holds the only copy

            def read_fails_half_way(tensors, host_views, deadline=None, fp8_scales=None):
                next(iter(host_views.values())).fill_(0)  # some bytes already written where it stages
                raise OSError("disk went away")

            monkeypatch.setattr(residency_module, "stage_tensors", read_fails_half_way)
            with pytest.raises(OSError):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(model_dir), version="b"))
            monkeypatch.undo()
            assert manager.version == "a"
            # Staged into a spare buffer: the served bytes are whole, so their digest is still the answer.
            assert (await manager.checksum(recompute=True)).overall == served
            woke = await manager.wake_up(WakeUpRequest())
            assert woke.bytes_moved == manager.residency.weights.nbytes  # type: ignore[union-attr]  # not re-read
            assert (await manager.checksum(recompute=True)).overall == served

    asyncio.run(scenario())


@pytest.mark.parametrize("stalls", ["header", "data"])
@pytest.mark.parametrize("woken_by", ["control", "request"])
def test_a_level2_wake_whose_read_stalls_fails_in_time_and_stays_asleep(tiny_model, monkeypatch, stalls, woken_by):
    from tidal.worker.checkpoint import header, reader
    from tidal.worker.lifecycle import manager as manager_module

    model_dir = tiny_model("llama")
    unblock = threading.Event()
    module, name = (header, "_header_json") if stalls == "header" else (reader, "_read_fully")
    real_read = getattr(module, name)

    def stalled(*args: object) -> object:
        unblock.wait()  # a stalled network file system: the read cannot be interrupted
        return real_read(*args)

    monkeypatch.setattr(manager_module, "_STAGE_GRACE_S", 0.5)

    async def scenario() -> None:
        async with running_manager(model_dir, checkpoint_read_timeout_s=0.5, asleep_requests="wake") as manager:
            before = await greedy(manager, [[5, 6, 7]])
            await manager.sleep(SleepRequest(level=2))
            monkeypatch.setattr(module, name, stalled)
            start = time.monotonic()
            try:
                if woken_by == "control":
                    with pytest.raises(WeightsUnavailableError, match="did not finish in"):
                        await asyncio.wait_for(manager.wake_up(WakeUpRequest()), 20)
                else:  # TIDAL_ASLEEP_REQUESTS=wake: the request is refused, not held for good
                    with pytest.raises(EngineNotRunningError, match="could not be woken"):
                        await asyncio.wait_for(greedy(manager, [[5, 6, 7]]), 20)
                assert time.monotonic() - start < 5
                # Not busy: the state answers, asleep; what uses the host buffer waits for the blocked read.
                state = manager.state()
                assert state.sleep_state == "asleep" and state.sleep_level == 2
                with pytest.raises(WeightsUnavailableError, match="still blocked"):
                    await manager.wake_up(WakeUpRequest())
            finally:
                unblock.set()  # the read returns at last
            monkeypatch.setattr(module, name, real_read)
            deadline = time.monotonic() + 10
            while True:
                try:
                    woke = await manager.wake_up(WakeUpRequest())
                    break
                except WeightsUnavailableError as err:
                    assert "still blocked" in str(err) and time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            assert woke.state.sleep_state == "awake"
            assert await greedy(manager, [[5, 6, 7]]) == before

    asyncio.run(scenario())
