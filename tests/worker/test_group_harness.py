"""The multi-process group harness: real worker processes on loopback, a conductor playing the operator, timed load.

With a dense model a rank of world_size > 1 applies `/group/reconfigure` as membership only, so these tests check
the harness's own mechanics (forming, detecting a crashed or frozen rank, the survivors' epoch, the replacement and
the whole group's epoch, the streams' outcomes and timings); the expert-parallel acceptance tests run on it.
Select them with `-m multiprocess`.
"""

from __future__ import annotations

import asyncio

import pytest

from tidal.contract.control_api import GroupHealth, GroupReconfigureResult, GroupStatus, SleepState, WorkerState
from tidal.worker.testing.group_conductor import ConductorEvent, EpochAttempt, EventKind, GroupConductor
from tidal.worker.testing.group_harness import GroupHarness, ranks_holding_every_copy, reference_texts
from tidal.worker.testing.recovery_metrics import count_streams, recovery_report, survivors_epoch
from tidal.worker.testing.streaming_load import StreamFailure, StreamRecord, StreamRequest, longest_gap
from tidal.worker.testing.worker_processes import WorkerLaunch, WorkerProcesses, WorkerStartError

PROMPTS = [f"Stream {i}: the tide comes in and" for i in range(6)]
MAX_TOKENS = 320  # a stream lasts well past the fault (about a second on a busy 2-core machine)


@pytest.mark.multiprocess
def test_a_killed_rank_is_noticed_the_survivors_go_on_and_a_replacement_rejoins(tiny_model, tmp_path):
    launch = WorkerLaunch(model_path=tiny_model("llama"), world_size=3, num_kv_blocks=128)
    reference = reference_texts(launch, PROMPTS, MAX_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, unresponsive_after_s=2.0) as group:
            conductor = group.conductor
            formed = conductor.applied
            assert formed is not None and (formed.epoch, formed.members, formed.coordinator_rank) == (1, [0, 1, 2], 0)
            async with group.load(PROMPTS, MAX_TOKENS).start() as load:
                await load.wait_streaming()
                fault_at = group.processes.kill(0)  # the coordinator: the survivors' epoch needs another
                records = await load.wait(timeout_s=120)
            whole = await conductor.wait_whole(after=fault_at, timeout_s=90)

            noticed = conductor.find(EventKind.FAULT_NOTICED, after=fault_at)
            assert noticed is not None and noticed.rank == 0 and "exited" in noticed.detail
            survivors = survivors_epoch(conductor, fault_at, [0])
            assert survivors is not None and (survivors.epoch, survivors.members, survivors.coordinator_rank) == (
                2, [1, 2], 1,
            )  # fmt: skip
            for result in survivors.results.values():
                assert (result.applied, result.state.group_epoch, result.state.group_formed) == (True, 2, False)
            assert (whole.epoch, whole.members, whole.coordinator_rank) == (3, [0, 1, 2], 1)
            assert conductor.find(EventKind.REPLACEMENT_LOADED, after=fault_at, rank=0) is not None
            assert group.processes[0].incarnation == 1
            for rank in (0, 1, 2):
                state = await group.state(rank)
                assert (state.group_epoch, state.group_formed, state.group.members) == (3, True, [0, 1, 2])
            assert await group.complete(0, PROMPTS[0], MAX_TOKENS) == reference[0]  # the replacement serves

            report = recovery_report("kill", fault_at, [0], conductor, records, reference)
            assert report.survivors.total == 4 and report.survivors.lost == 0, _outcomes(records)
            assert report.failed_rank.total == 2 and report.failed_rank.other_failures == 0, _outcomes(records)
            _check_failed_rank_streams(records, [0], fault_at)
            assert report.whole_epoch == 3 and report.whole_after_replacement_s is not None
            assert report.detection_s is not None and report.detection_s < 2.0

    asyncio.run(scenario())


@pytest.mark.multiprocess
def test_a_frozen_rank_is_found_by_its_silence_killed_and_replaced_on_request(tiny_model, tmp_path):
    launch = WorkerLaunch(model_path=tiny_model("llama"), world_size=2, num_kv_blocks=128)
    prompts = PROMPTS[:4]
    reference = reference_texts(launch, prompts, MAX_TOKENS)

    async def scenario() -> None:
        options = {"unresponsive_after_s": 1.0, "replace_failed": False}
        async with GroupHarness(launch, workdir=tmp_path, **options) as group:
            conductor = group.conductor
            async with group.load(prompts, MAX_TOKENS).start() as load:
                await load.wait_streaming()
                fault_at = group.processes.freeze(1)
                killed = await conductor.wait_for(EventKind.RANK_KILLED, after=fault_at, rank=1, timeout_s=30)
                records = await load.wait(timeout_s=120)
            noticed = conductor.find(EventKind.FAULT_NOTICED, after=fault_at, rank=1)
            assert noticed is not None and "no /state answer" in noticed.detail
            assert killed.at - fault_at >= 1.0 and not group.processes[1].is_running

            await conductor.wait_for(EventKind.EPOCH_APPLIED, after=fault_at, timeout_s=30)
            survivor = await group.state(0)
            assert (survivor.group_epoch, survivor.group_formed, survivor.group.members) == (2, False, [0])
            assert survivor.group.health is GroupHealth.SOLO  # a dense model: membership only, no expert parallelism
            assert conductor.find(EventKind.REPLACEMENT_STARTED, after=fault_at) is None  # not on its own

            conductor.replace(1)
            whole = await conductor.wait_whole(after=fault_at, timeout_s=90)
            assert (whole.epoch, whole.members, whole.coordinator_rank) == (3, [0, 1], 0)
            assert (await group.state(1)).group_epoch == 3

            report = recovery_report("stop", fault_at, [1], conductor, records, reference)
            assert report.survivors.total == 2 and report.survivors.lost == 0, _outcomes(records)
            assert report.failed_rank.total == 2 and report.failed_rank.other_failures == 0, _outcomes(records)
            _check_failed_rank_streams(records, [1], fault_at)  # frozen mid-stream, then killed

    asyncio.run(scenario())


@pytest.mark.multiprocess
def test_a_worker_that_cannot_start_fails_the_wait_with_its_log(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with WorkerProcesses(WorkerLaunch(model_path=model, world_size=1), tmp_path / "logs") as processes:
        processes.start(0)
        with pytest.raises(WorkerStartError, match=r"(?s)rank 0 .*exited while loading.*model_type"):
            asyncio.run(processes.wait_loaded(0, timeout_s=60))


def _check_failed_rank_streams(records: list[StreamRecord], failed: list[int], fault_at: float) -> None:
    """A failed rank's stream either ended before the fault or lost its connection; at least one was cut."""
    on_failed = [r for r in records if r.request.rank in failed]
    for record in on_failed:
        assert record.lost_connection or (record.completed and record.ended_at < fault_at), _outcomes(records)
    assert any(r.lost_connection for r in on_failed), _outcomes(records)


def _outcomes(records: list[StreamRecord]) -> str:
    return "\n".join(
        f"stream {r.request.index} on rank {r.request.rank}: {r.failure or r.finish_reason} {r.error or ''} "
        f"{len(r.chunk_times)} chunks"
        for r in records
    )


# ----- the pure parts -----


def _record(index: int, rank: int, times: list[float], text: str = "", failure: StreamFailure | None = None):
    record = StreamRecord(StreamRequest(index, rank, "p", 4), chunk_times=times, pieces=[text], failure=failure)
    record.finish_reason = None if failure is not None else "length"
    return record


def test_a_gap_counts_in_every_window_it_overlaps():
    times = [0.0, 0.1, 0.2, 1.5, 1.6]
    assert longest_gap(times) == pytest.approx(1.3)
    assert longest_gap(times, after=1.0) == pytest.approx(1.3)  # the gap the fault fell into
    assert longest_gap(times, after=1.55) == pytest.approx(0.1)
    assert longest_gap(times, before=0.15) == pytest.approx(0.1)
    assert longest_gap(times, before=1.0) == pytest.approx(1.3)  # it starts before 1.0: the rejoin began inside it
    assert longest_gap([1.0]) is None and longest_gap(times, after=2.0) is None
    assert _record(0, 0, times).first_chunk_after(0.25) == 1.5


def test_streams_are_counted_against_the_reference():
    records = [
        _record(0, 0, [0.0], "a"),
        _record(1, 0, [0.0], "wrong"),
        _record(2, 1, [0.0], failure=StreamFailure.CONNECTION),
        _record(3, 1, [0.0], failure=StreamFailure.TIMEOUT),
    ]
    counts = count_streams(records, ["a", "b", "c", "d"])
    assert (counts.total, counts.completed, counts.wrong_output) == (4, 2, 1)
    assert (counts.connection_errors, counts.other_failures, counts.lost) == (1, 1, 3)


def _answer(rank: int, epoch: int, duration_s: float, reload_s: float | None = None) -> GroupReconfigureResult:
    group = GroupStatus(health=GroupHealth.SERVING, expert_reload_s=reload_s, degraded_experts=[5] if reload_s else [])
    state = WorkerState(
        sleep_state=SleepState.AWAKE, resident=[], weights_version="base", model_loaded=True, rank=rank, world_size=2,
        group_epoch=epoch, coordinator_rank=0, group_formed=False, in_flight_requests=0,
        group=group,
    )  # fmt: skip
    return GroupReconfigureResult(applied=True, duration_s=duration_s, state=state)


def _attempt(epoch: int, members: list[int], sent_at: float, applied: bool, reload_s: float | None = None):
    attempt = EpochAttempt(epoch, members, 0, sent_at=sent_at, answered_at=sent_at + 0.2)
    attempt.results = {r: _answer(r, epoch, 0.2, reload_s) for r in members}
    if not applied:
        attempt.refusals = {members[0]: "503 group_unreachable: timed out"}
    return attempt


def test_a_report_reads_the_conductors_events_and_the_streams(tmp_path):
    conductor = GroupConductor(WorkerProcesses(WorkerLaunch(model_path=tmp_path, world_size=2), tmp_path))
    conductor.attempts = [
        _attempt(1, [0, 1], 0.0, applied=True),
        _attempt(2, [0], 10.5, applied=False),  # refused: not the survivors' epoch yet
        _attempt(3, [0], 10.7, applied=True, reload_s=0.3),
        _attempt(4, [0, 1], 14.0, applied=True),
    ]
    conductor.events = [
        ConductorEvent(EventKind.FAULT_NOTICED, 10.4, 1),
        ConductorEvent(EventKind.REPLACEMENT_STARTED, 11.5, 1),
        ConductorEvent(EventKind.REPLACEMENT_LOADED, 13.5, 1),
        ConductorEvent(EventKind.WHOLE, 14.2, None, 4),
    ]
    survivors = [_record(0, 0, [9.8, 9.9, 11.0, 11.1, 12.0, 13.0, 13.9, 14.5], "a")]
    failed = [_record(1, 1, [9.9], failure=StreamFailure.CONNECTION)]
    report = recovery_report("kill", 10.0, [1], conductor, survivors + failed, ["a", "b"])
    assert report.detection_s == pytest.approx(0.4) and report.survivors_epoch == 3
    assert report.survivors_reconfigure_s == pytest.approx(0.2)
    assert report.fault_to_serving_s == pytest.approx(1.0)  # the first chunk (11.0) after epoch 3 was answered (10.9)
    assert report.interruption_s == pytest.approx(1.1)  # 9.9 -> 11.0: the gap the fault fell into
    assert report.rejoin_interruption_s == pytest.approx(0.6)  # 13.9 -> 14.5: the rejoin's epoch was sent inside it
    assert report.replacement_load_s == pytest.approx(2.0) and report.whole_after_replacement_s == pytest.approx(2.7)
    assert (report.expert_reload_s, report.degraded_experts, report.whole_epoch) == (0.3, [5], 4)
    assert (report.survivors.lost, report.failed_rank.connection_errors) == (0, 1)
    assert report.to_json()["lost_on_survivors"] == 0 and report.to_json()["lost_on_failed_rank"] == 1
    assert "requests lost on survivors:          0 of 1" in report.summary()


def test_ranks_holding_every_copy_of_an_expert():
    layout = {"num_experts": 4, "group_size": 4, "slots_per_rank": 2, "slots": [[0, 1], [1, 2], [2, 3], [3, 0]]}
    assert ranks_holding_every_copy(layout, 4, 2) == [1, 2]  # expert 2 lives on ranks 1 and 2 only
    assert ranks_holding_every_copy(None, 4, 2) == [2, 3]
    with pytest.raises(ValueError, match="no survivor"):
        ranks_holding_every_copy(None, 2, 2)
