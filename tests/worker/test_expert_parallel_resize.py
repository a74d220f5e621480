"""A running expert-parallel group resized by epochs (worker processes, gloo on CPU): 3 -> 4 -> 3 ranks, the ranks
that stay never restarted, requests completing across every switch.

The group starts with 3 ranks of S = ceil(8 / 3) + 1 = 4 expert slots each. A 4th rank started for a group of 4 with
its own default slot count (ceil(8 / 4) + 1 = 3) is refused by every member, at once and naming both counts; started
with the running members' count it joins an epoch of group_size 4, and every rank then answers what one process
answers (itself equal to transformers, see test_expert_parallel_group.py). An epoch of group_size 3 leaves it out
and the 3 serve on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tidal.contract.control_api import GroupHealth
from tidal.worker.experts.expert_map import GroupShape
from tidal.worker.experts.full_layout import full_layout
from tidal.worker.testing.group_harness import GroupHarness, reference_texts
from tidal.worker.testing.worker_processes import WorkerLaunch

pytestmark = pytest.mark.multiprocess

PROMPTS = [f"Stream {i}: the tide comes in and" for i in range(3)]
MAX_TOKENS = 48
NUM_EXPERTS = 8  # of the tiny MoE models


async def _check_state(group: GroupHarness, group_size: int, slots_per_rank: int, layout: dict[str, object]) -> None:
    for rank in group.processes.ranks:
        state = await group.state(rank)
        assert state.group.health is GroupHealth.SERVING and state.group.members == list(range(group_size))
        assert (state.group.group_size, state.group.slots_per_rank) == (group_size, slots_per_rank)
        assert state.group.expert_map == layout and state.group_formed


async def _every_rank_serves(group: GroupHarness, reference: list[str]) -> None:
    ranks = group.processes.ranks
    texts = await asyncio.gather(*(group.complete(r, p, MAX_TOKENS) for r in ranks for p in PROMPTS))
    assert texts == [ref for _ in ranks for ref in reference]


def test_a_group_grows_to_four_ranks_and_shrinks_back_to_three_while_it_serves(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    launch = WorkerLaunch(
        model_path=tiny_model("qwen3_moe"), world_size=3, redundant_experts_per_rank=1, num_kv_blocks=256,
        group_timeout_s=1.0,
    )  # fmt: skip
    reference = reference_texts(launch, PROMPTS, MAX_TOKENS)
    three = GroupShape.even_share(NUM_EXPERTS, 3, 1)
    four = three.resized(4)

    async def scenario() -> None:
        async with GroupHarness(launch, workdir=tmp_path, watch=False) as group:
            await _check_state(group, 3, 4, full_layout(three).to_json())
            pids = [group.processes[r].popen.pid for r in (0, 1, 2)]
            async with group.load(PROMPTS, MAX_TOKENS, ranks=[0, 1, 2]).start(repeat=True) as load:
                await load.wait_streaming()

                # A 4th rank with its own slot count: every member refuses, at once, and the 3 keep serving.
                mismatched = dataclasses.replace(launch, world_size=4)
                group.processes.start(3, mismatched)
                await group.processes.wait_loaded(3)
                attempt = await group.conductor.send_epoch([0, 1, 2, 3], group_size=4)
                assert not attempt.applied and sorted(attempt.refusals) == [0, 1, 2, 3]
                for why in attempt.refusals.values():
                    assert "409 experts_unavailable" in why and "ranks [0, 1, 2] have 4, ranks [3] have 3" in why, why
                    assert "--expert-slots-per-rank 4" in why, why
                assert attempt.answered_at is not None and attempt.answered_at - attempt.sent_at < 10.0  # no wait
                group.processes.stop(3)

                # Started with the running count it joins the group of 4; the 3 were never restarted.
                slots = (await group.state(0)).group.slots_per_rank
                assert slots == 4
                grown = await group.grow(4, dataclasses.replace(mismatched, expert_slots_per_rank=slots))
                assert grown.results[3].loaded_experts == []  # it started with its slots of the group of 4
                await _check_state(group, 4, 4, full_layout(four).to_json())
                await _every_rank_serves(group, reference)

                # Back to 3: rank 3 is left out (then stopped), the others return to the layout they started with.
                await group.shrink(3)
                await _check_state(group, 3, 4, full_layout(three).to_json())
                await _every_rank_serves(group, reference)
                assert [group.processes[r].popen.pid for r in (0, 1, 2)] == pids
                load.stop_repeating()
                records = await load.wait(timeout_s=120)
            assert len(records) > len(PROMPTS)  # streams were running through the switches
            for record in records:
                assert record.completed, (record.request, record.failure, record.error)
                assert record.text == reference[record.request.index]

    asyncio.run(scenario())
