"""The pure side of async scheduling: tokens a launched step samples stand as UNKNOWN_TOKEN until read; they never
reach a prefix hash, the next step's plan takes them from the previous step's samples, stop checks look at the
sequence as of their own step, and a sequence that must end by length leaves the batch before it is read."""

from __future__ import annotations

import pytest

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits
from tidal.worker.engine.sequence import UNKNOWN_TOKEN, Sequence
from tidal.worker.engine.step_plan import build_step_plan
from tidal.worker.engine.stop_checker import reaches_length_limit, token_stop_reason


def make(num_blocks: int = 32, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerLimits(8, 64), BlockManager(num_blocks, block_size))


def seq(seq_id: int, n: int, params: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(10, 10 + n)), params or SamplingParams(max_tokens=50))


def launch(s: Scheduler):
    out = s.schedule()
    s.on_step_launched(out)
    return out


def test_a_block_with_an_unknown_token_is_hashed_only_once_the_token_is_known():
    s = make()
    a = seq(0, 7)  # the sampled token is the 8th: it fills block 1
    s.add(a)
    launch(s)  # prefill: computes 0..6, appends UNKNOWN_TOKEN at 7
    assert a.token_ids[-1] == UNKNOWN_TOKEN and a.num_computed_tokens == 7
    out = launch(s)  # the decode that computes position 7 from the still-unknown token
    assert a.num_computed_tokens == 8 and a.token_ids[7] == UNKNOWN_TOKEN
    s.commit(out)
    assert len(a.block_hashes) == 1  # block 0 only: block 1 holds the unknown token
    assert all(UNKNOWN_TOKEN not in b.token_ids for b in s.block_manager.blocks)
    a.token_ids[7] = 99  # read
    s.commit(out)
    assert len(a.block_hashes) == 2
    assert s.block_manager.blocks[a.block_table[1]].token_ids == (14, 15, 16, 99)


def test_the_plan_takes_unknown_inputs_from_the_previous_steps_samples():
    s = make()
    a, b = seq(0, 3), seq(1, 5)
    s.add(a)
    s.add(b)
    launch(s)  # both prefill and sample: rows 0 (a) and 1 (b) of that step's samples
    c = seq(2, 2)
    s.add(c)
    out = s.schedule()
    plan = build_step_plan(out, 4, {0: 0, 1: 1})
    assert plan.input_ids == [UNKNOWN_TOKEN, UNKNOWN_TOKEN, 10, 11]
    assert (plan.unknown_rows, plan.unknown_sources) == ([0, 1], [0, 1])
    with pytest.raises(RuntimeError, match="unknown"):
        build_step_plan(out, 4)  # nobody says where the unknown tokens come from
    reordered = build_step_plan(out, 4, {0: 1, 1: 0})
    assert reordered.unknown_sources == [1, 0]


def test_stop_checks_look_at_the_sequence_as_of_their_own_step():
    params = SamplingParams(max_tokens=3, stop_token_ids=[42])
    a = Sequence(0, "r0", [1, 2], params, token_ids=[1, 2, 42, UNKNOWN_TOKEN])
    assert token_stop_reason(a, set(), 100, num_tokens=3) == "stop"
    b = Sequence(1, "r1", [1, 2], params, token_ids=[1, 2, 5, UNKNOWN_TOKEN])
    assert token_stop_reason(b, set(), 100, num_tokens=3) is None
    assert reaches_length_limit(b, 5, 100) and not reaches_length_limit(b, 4, 100)
    assert reaches_length_limit(b, 4, max_model_len=4)
    b.drop_unknown_tokens()
    assert b.token_ids == [1, 2, 5] and b.num_output_tokens == 1


def test_a_retired_sequence_frees_its_blocks_and_the_next_schedule_is_as_if_it_had_ended():
    def first_two_steps(end):
        s = make(num_blocks=5)  # room for two of the three prompts
        seqs = [seq(i, 8, SamplingParams(max_tokens=1)) for i in range(3)]
        for x in seqs:
            s.add(x)
        launch(s)
        end(s, seqs[0])
        return [(item.seq.seq_id, item.num_new_tokens) for item in s.schedule().scheduled], s

    retired, s = first_two_steps(lambda s, x: s.retire([x]))
    ended, _ = first_two_steps(lambda s, x: s.finish(x, "length"))
    assert retired == ended == [(1, 1), (2, 8)]  # the third prompt got the first one's blocks
    assert s.running[0].seq_id == 1
