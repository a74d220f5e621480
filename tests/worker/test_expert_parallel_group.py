"""Expert parallelism end to end: groups of real worker processes (gloo on CPU), each rank a serving endpoint.

The harness (`tidal.worker.testing.group_harness`) starts one `python -m tidal.worker` per rank and plays the
operator: it forms epochs, watches `/state` and the processes, gives the survivors of a fault the next epoch, starts
a replacement and brings the group back whole. Greedy outputs are compared with one single-process worker of the same
model (itself equal to transformers, see test_moe_models.py) and, for the first group, with transformers directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tidal.contract.control_api import GroupHealth
from tidal.worker.experts.expert_map import ExpertMap, GroupShape
from tidal.worker.experts.placement import plan_placement
from tidal.worker.testing.group_conductor import EventKind
from tidal.worker.testing.group_harness import GroupHarness, ranks_holding_every_copy, reference_texts
from tidal.worker.testing.hf_reference import transformers_greedy
from tidal.worker.testing.recovery_metrics import recovery_report, survivors_epoch
from tidal.worker.testing.tiny_models import write_tiny_model
from tidal.worker.testing.worker_processes import WorkerLaunch

pytestmark = pytest.mark.multiprocess

PROMPTS = [f"Stream {i}: the tide comes in and" for i in range(8)]
MAX_TOKENS = 24
LOAD_TOKENS = 160  # a stream lasts past the fault on a busy 2-core machine
NUM_EXPERTS = 8  # of the tiny MoE models


def _launch(model: Path, world_size: int = 4, redundant: int = 1, **options: object) -> WorkerLaunch:
    return WorkerLaunch(
        model_path=model, world_size=world_size, redundant_experts_per_rank=redundant, num_kv_blocks=256,
        group_timeout_s=1.0, **options,  # type: ignore[arg-type]
    )  # fmt: skip


def _full_layout(world_size: int, redundant: int) -> dict[str, object]:
    return plan_placement(
        GroupShape.even_share(NUM_EXPERTS, world_size, redundant), range(world_size)
    ).expert_map.to_json()


async def _every_rank_serves(
    group: GroupHarness, reference: list[str], prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> None:
    """Each prompt sent to every rank at once gives the reference text."""
    ranks = group.processes.ranks
    texts = await asyncio.gather(*(group.complete(r, p, max_tokens) for r in ranks for p in prompts))
    expected = [ref for _ in ranks for ref in reference]
    assert texts == expected


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_group_of_four_ranks_serves_exactly_what_one_process_serves(
    arch: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    launch = _launch(tiny_model(arch))
    reference = reference_texts(launch, PROMPTS, MAX_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, watch=False) as group:
            for rank in group.processes.ranks:
                state = await group.state(rank)
                assert state.group.health is GroupHealth.SERVING and state.group.members == [0, 1, 2, 3]
                assert state.group.expert_map == _full_layout(4, 1)
                held = [e for e in state.group.held_experts if e is not None]
                assert len(held) == 3 and len(set(held)) == 3  # ceil(8 / 4) + 1 slots, no expert twice
            await _every_rank_serves(group, reference)

    asyncio.run(scenario())
    if arch == "qwen3_moe":  # and the single process is transformers' own greedy output
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(launch.model_path)
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:3]]
        expected = transformers_greedy(launch.model_path, prompt_ids, MAX_TOKENS)
        assert [tokenizer.decode(ids) for ids in expected] == reference[:3]


def test_under_load_a_killed_rank_costs_the_survivors_nothing_and_is_replaced(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    launch = _launch(tiny_model("qwen3_moe"))
    reference = reference_texts(launch, PROMPTS, LOAD_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, unresponsive_after_s=3.0) as group:
            async with group.load(PROMPTS, LOAD_TOKENS).start() as load:  # 8 streams, two on every rank
                await load.wait_streaming()
                fault_at = group.processes.kill(2)
                records = await load.wait(timeout_s=180)
            whole = await group.conductor.wait_whole(after=fault_at, timeout_s=120)
            report = recovery_report("kill", fault_at, [2], group.conductor, records, reference)
            assert report.survivors.total == 6 and report.survivors.lost == 0, report.summary()
            assert report.failed_rank.connection_errors == report.failed_rank.total - report.failed_rank.completed
            assert report.failed_rank.other_failures == 0, report.summary()
            survivors = survivors_epoch(group.conductor, fault_at, [2])
            assert survivors is not None and survivors.members == [0, 1, 3]
            for result in survivors.results.values():
                assert result.state.group.health is GroupHealth.SERVING
            # The replacement rejoined and the group is back on its full layout, serving correctly everywhere.
            assert whole.members == [0, 1, 2, 3]
            for rank in group.processes.ranks:
                state = await group.state(rank)
                assert state.group.expert_map == _full_layout(4, 1) and state.group_formed
            await _every_rank_serves(group, reference[:2], PROMPTS[:2], LOAD_TOKENS)

    asyncio.run(scenario())


def test_a_frozen_rank_breaks_the_group_at_the_deadline_and_the_survivors_go_on(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    launch = _launch(tiny_model("qwen3_moe"))
    reference = reference_texts(launch, PROMPTS, LOAD_TOKENS)

    async def scenario() -> None:
        # The conductor waits longer than the collective deadline: the survivors find the frozen peer themselves
        # and name it in /state before the conductor would notice the silence.
        async with GroupHarness(launch, workdir=tmp_path, unresponsive_after_s=4.0) as group:
            async with group.load(PROMPTS, LOAD_TOKENS).start() as load:
                await load.wait_streaming()
                fault_at = group.processes.freeze(1)
                noticed = await group.conductor.wait_for(EventKind.FAULT_NOTICED, after=fault_at, timeout_s=30)
                records = await load.wait(timeout_s=180)
            await group.conductor.wait_whole(after=fault_at, timeout_s=120)
            assert noticed.rank == 1 and "broken" in noticed.detail, noticed
            assert noticed.at - fault_at < 3.5  # the 1 s deadline and a probe, not the conductor's 4 s silence
            report = recovery_report("stop", fault_at, [1], group.conductor, records, reference)
            assert report.survivors.total == 6 and report.survivors.lost == 0, report.summary()
            await _every_rank_serves(group, reference[:2], PROMPTS[:2], LOAD_TOKENS)

    asyncio.run(scenario())


def test_losing_every_copy_of_an_expert_makes_the_survivors_reload_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    # Two redundant slots per rank: the two survivors have room (2 x 4 slots) for all 8 experts.
    launch = _launch(tiny_model("qwen3_moe"), redundant=2)
    reference = reference_texts(launch, PROMPTS, LOAD_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, unresponsive_after_s=3.0) as group:
            layout = _full_layout(4, 2)
            failing = ranks_holding_every_copy(layout, 4, 2)
            lost = [
                e for e in range(NUM_EXPERTS) if {c.rank for c in ExpertMap.from_json(layout).copies(e)} <= set(failing)
            ]
            assert lost, failing
            async with group.load(PROMPTS, LOAD_TOKENS).start() as load:
                await load.wait_streaming()
                fault_at = group.processes.kill(failing[0])
                group.processes.kill(failing[1])
                records = await load.wait(timeout_s=180)
            await group.conductor.wait_whole(after=fault_at, timeout_s=180)
            survivors = survivors_epoch(group.conductor, fault_at, failing)
            assert survivors is not None
            reloaded = sorted({e for r in survivors.results.values() for e in r.loaded_experts})
            assert set(lost) <= set(reloaded)
            for result in survivors.results.values():
                assert set(lost) <= set(result.state.group.degraded_experts)
                assert result.state.group.expert_reload_s is not None
            report = recovery_report("kill2", fault_at, failing, group.conductor, records, reference)
            assert report.survivors.lost == 0, report.summary()
            await _every_rank_serves(group, reference[:2], PROMPTS[:2], LOAD_TOKENS)

    asyncio.run(scenario())


def test_an_epoch_without_room_for_every_expert_is_refused_and_the_old_state_kept(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    # No redundancy: 4 ranks x 2 slots hold the 8 experts once; 3 ranks have 6 slots, too few.
    launch = _launch(tiny_model("qwen3_moe"), redundant=0)
    reference = reference_texts(launch, PROMPTS[:2], MAX_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, watch=False) as group:
            await _every_rank_serves(group, reference, PROMPTS[:2])
            attempt = await group.conductor.send_epoch([0, 1, 2])  # as if rank 3 were gone
            assert not attempt.applied
            for rank in (0, 1, 2):
                why = attempt.refusals[rank]
                assert "experts_unavailable" in why and "slots" in why, why
                state = await group.state(rank)
                assert state.group_epoch == 1  # the refused epoch changed nothing
            # The coordinator refused before any rank switched: the old epoch still serves, all four ranks.
            await _every_rank_serves(group, reference, PROMPTS[:2])

    asyncio.run(scenario())


def test_the_group_shrinks_and_grows_by_epochs_without_restarting_a_rank(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    launch = _launch(tiny_model("qwen3_moe"))
    reference = reference_texts(launch, PROMPTS[:2], MAX_TOKENS)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, watch=False) as group:
            pids = [group.processes[r].popen.pid for r in group.processes.ranks]
            await group.conductor.form([0, 1, 2])  # 4 -> 3: rank 3 leaves (it keeps running, unused)
            texts = await asyncio.gather(*(group.complete(r, p, MAX_TOKENS) for r in (0, 1, 2) for p in PROMPTS[:2]))
            assert texts == reference * 3
            await group.conductor.form([0, 1, 2, 3])  # 3 -> 4: it comes back
            await _every_rank_serves(group, reference, PROMPTS[:2])
            assert [group.processes[r].popen.pid for r in group.processes.ranks] == pids
            state = await group.state(3)
            assert state.group.expert_map == _full_layout(4, 1) and state.group_epoch == 3

    asyncio.run(scenario())


def test_sleep_wake_update_and_checksums_work_on_every_rank_of_a_group(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_model("qwen3_moe")
    v2 = write_tiny_model("qwen3_moe", tmp_path / "v2", seed=7)
    launch = _launch(base)
    reference = reference_texts(launch, PROMPTS[:2], MAX_TOKENS)
    reference_v2 = reference_texts(_launch(v2), PROMPTS[:2], MAX_TOKENS)
    assert reference_v2 != reference

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path / "group", watch=False) as group:
            ranks = group.processes.ranks
            for level in (1, 2):
                await asyncio.gather(*(group.control(r, "/sleep", {"level": level}) for r in ranks))
                await asyncio.gather(*(group.control(r, "/wake_up", {}) for r in ranks))
                await _every_rank_serves(group, reference, PROMPTS[:2])
            body = {"source": str(v2), "version": "v2"}
            await asyncio.gather(*(group.control(r, "/weights/update", body) for r in ranks))
            await _every_rank_serves(group, reference_v2, PROMPTS[:2])
            sums = await asyncio.gather(*(group.control(r, "/weights/checksum", None, method="GET") for r in ranks))
            for rank, checksum in zip(ranks, sums, strict=True):
                state = await group.state(rank)
                held = {e for e in state.group.held_experts if e is not None}
                experts = {int(n.split(".experts.")[1].split(".")[0]) for n in checksum["tensors"] if ".experts." in n}
                assert checksum["version"] == "v2" and experts == held  # each rank hashes what it serves
                assert checksum["covers_experts"] == sorted(held)

    asyncio.run(scenario())


def test_fp8_experts_change_slots_by_an_epoch_then_update_and_wake_from_a_16_bit_checkpoint(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """FP8 experts' served names follow the slots: after an epoch that has the survivors read the missing experts,
    updates from 16-bit checkpoints and a level-2 wake (both quantize on the way in) plan their reads from the names
    served now, and the model comes back to the same bytes and texts."""
    base = tiny_model("qwen3_moe")
    v2 = write_tiny_model("qwen3_moe", tmp_path / "v2", seed=7)
    launch = _launch(base, extra_flags=("--weight-dtype", "fp8"))
    survivors = (0, 1, 2)

    async def texts(group: GroupHarness) -> list[str]:
        return await asyncio.gather(*(group.complete(r, p, MAX_TOKENS) for r in survivors for p in PROMPTS[:2]))

    async def checksums(group: GroupHarness) -> list[str]:
        sums = await asyncio.gather(*(group.control(r, "/weights/checksum", None, method="GET") for r in survivors))
        return [s["overall"] for s in sums]

    async def everyone(group: GroupHarness, path: str, body: dict[str, object]) -> None:
        await asyncio.gather(*(group.control(r, path, body) for r in survivors))

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path / "group", watch=False) as group:
            attempt = await group.conductor.form(list(survivors))  # rank 3 leaves: its only copies are reloaded
            assert any(result.loaded_experts for result in attempt.results.values())
            before, sums_before = await texts(group), await checksums(group)
            await everyone(group, "/weights/update", {"source": str(v2), "version": "v2"})
            assert await texts(group) != before
            await everyone(group, "/weights/update", {"source": str(base), "version": "base"})
            await everyone(group, "/sleep", {"level": 2})
            await everyone(group, "/wake_up", {})  # re-reads the served version, quantizing it again
            assert await checksums(group) == sums_before
            assert await texts(group) == before

    asyncio.run(scenario())
