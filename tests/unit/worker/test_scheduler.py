"""Scheduler: mixing prefills and decodes, budgets, chunked prefill and preemption (no torch)."""

from __future__ import annotations

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits
from tidal.worker.engine.sequence import Sequence, SequenceStatus
from tidal.worker.engine.step_plan import build_step_plan

PARAMS = SamplingParams()


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, prefix=True) -> Scheduler:
    return Scheduler(SchedulerLimits(max_num_seqs, max_tokens), BlockManager(num_blocks, block_size, prefix))


def seq(seq_id: int, n: int, first: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(first, first + n)), PARAMS)


def run_step(s: Scheduler, next_token: int = 7):
    out = s.schedule()
    sampled = {item.seq.seq_id: next_token for item in out.scheduled if item.will_sample}
    s.on_step_done(out, sampled)
    return out


def test_prefill_then_decode_with_newcomer_in_same_step():
    s = make()
    a = seq(0, 5)
    s.add(a)
    out = run_step(s)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 5)]
    assert a.num_tokens == 6 and a.num_computed_tokens == 5
    b = seq(1, 3, first=100)
    s.add(b)
    out = s.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(0, 1), (1, 3)]
    plan = build_step_plan(out, 4)
    assert plan.input_ids == [7, 100, 101, 102]
    assert plan.positions == [5, 0, 1, 2]
    assert plan.cu_seqlens_q == [0, 1, 4]
    assert plan.seq_lens == [6, 3]
    assert plan.sample_indices == [0, 3]
    assert not plan.is_decode_only
    assert plan.slot_mapping[0] == a.block_table[1] * 4 + 1


def test_token_budget_chunks_a_long_prompt():
    s = make(max_tokens=4)
    a = seq(0, 10)
    s.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        out = run_step(s)
        chunks.append(out.scheduled[0].num_new_tokens)
        assert out.num_batched_tokens <= 4
    assert chunks == [4, 4, 2]
    assert a.num_computed_tokens == 10


def test_only_the_last_chunk_samples():
    s = make(max_tokens=4)
    s.add(seq(0, 6))
    first = s.schedule()
    assert not first.scheduled[0].will_sample
    assert build_step_plan(first, 4).sample_indices == []


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, 2, first=10 * i))
    out = s.schedule()
    assert len(out.scheduled) == 2
    assert s.num_waiting == 1


def test_preemption_frees_newest_and_requeues_it_first():
    # 3 blocks of 2 tokens: two sequences of 2-token prompts fill two blocks, then they grow.
    s = make(num_blocks=3, block_size=2, prefix=False)
    a, b = seq(0, 2), seq(1, 2, first=50)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled, each holds 1 block, each has 3 tokens
    run_step(s)  # decode: a takes block 3; b can't grow -> b preempted
    assert s.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b]
    assert b.num_tokens == 3  # its sampled token is kept and recomputed as part of the prompt
    s.finish(a, "stop")
    out = s.schedule()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(1, 3)]


def test_a_lone_sequence_preempts_itself_when_nothing_else_can_go():
    s = make(num_blocks=1, block_size=2, prefix=False)
    a = seq(0, 2)
    s.add(a)
    run_step(s)
    out = s.schedule()  # a needs a second block: none exists
    assert out.scheduled == [] and out.preempted == [a]


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=2, block_size=2, prefix=False)
    a, b = seq(0, 2), seq(1, 2, first=50)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()
    assert out.preempted == [b]
    assert [i.seq.seq_id for i in out.scheduled] == [0]


def test_finish_frees_blocks():
    s = make(num_blocks=4, block_size=2, prefix=False)
    a = seq(0, 3)
    s.add(a)
    run_step(s)
    assert s.block_manager.num_free_blocks == 2
    s.finish(a, "length")
    assert s.block_manager.num_free_blocks == 4
    assert not s.has_unfinished()
    assert a.finish_reason == "length"


def test_decode_only_plan():
    s = make()
    s.add(seq(0, 3))
    s.add(seq(1, 2, first=30))
    run_step(s)
    plan = build_step_plan(s.schedule(), 4)
    assert plan.is_decode_only
    assert plan.positions == [3, 2]
    assert plan.sample_seq_ids == [0, 1]
