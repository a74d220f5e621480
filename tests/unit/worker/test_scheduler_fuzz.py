"""Scheduler + BlockManager under random load: tight cache, chunked prefills, shared prefixes, aborts.
After every step the block accounting must add up; in the end every request finishes and every block is free."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits
from tidal.worker.engine.sequence import Sequence, SequenceStatus
from tidal.worker.engine.step_plan import build_step_plan

BLOCK = 4
NUM_BLOCKS = 24
MAX_LEN = NUM_BLOCKS * BLOCK  # a sequence may always fit the cache alone


def check_invariants(s: Scheduler, live: list[Sequence]) -> None:
    bm = s.block_manager
    refs = Counter(b for seq in live for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), block
    assert bm.num_free_blocks == NUM_BLOCKS - len(refs)
    for seq in live:
        if seq.status is SequenceStatus.WAITING:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        else:
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens
    assert len(s.running) <= s.limits.max_num_seqs


@pytest.mark.parametrize("seed", range(6))
def test_random_load_keeps_accounting_straight(seed):
    rng = random.Random(seed)
    s = Scheduler(SchedulerLimits(max_num_seqs=5, max_num_batched_tokens=16), BlockManager(NUM_BLOCKS, BLOCK))
    shared = [rng.randrange(100) for _ in range(12)]
    live: list[Sequence] = []
    next_id = 0
    target: dict[int, int] = {}
    steps = 0
    while next_id < 30 or live:
        if next_id < 30 and rng.random() < 0.4:
            prefix = shared[: rng.randrange(0, 12)] if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
            seq = Sequence(next_id, f"r{next_id}", prompt, SamplingParams())
            target[next_id] = min(MAX_LEN, len(prompt) + rng.randrange(1, 20))
            next_id += 1
            s.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            s.finish(victim, "abort")
            live.remove(victim)
        out = s.schedule()
        plan = build_step_plan(out, BLOCK)
        assert plan.num_tokens <= 16 and plan.num_seqs <= 5
        assert len(set(plan.slot_mapping)) == len(plan.slot_mapping)  # no two tokens write one slot
        sampled = {item.seq.seq_id: rng.randrange(100) for item in out.scheduled if item.will_sample}
        s.on_step_done(out, sampled)
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id in sampled and seq.num_tokens >= target[seq.seq_id]:
                s.finish(seq, "length")
                live.remove(seq)
        check_invariants(s, live)
        steps += 1
        assert steps < 5000, "no progress"
    assert s.block_manager.num_free_blocks == NUM_BLOCKS
    assert not s.has_unfinished()
    # The load really was tight and really shared prefixes (else this test would prove little).
    assert s.num_preemptions > 0 and s.block_manager.num_prefix_hit_tokens > 0
