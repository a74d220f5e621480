"""n samples of one prompt at the block level: a fork shares the prompt's full blocks (reference counts), copies the
partly filled last one, and freeing every sample gives every block back (no device)."""

from __future__ import annotations

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.fork import Forks, sample_params
from tidal.worker.engine.in_flight import EngineRequest, PendingToken
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits
from tidal.worker.engine.sequence import UNKNOWN_TOKEN, Sequence, SequenceStatus

PARAMS = SamplingParams()


def prefilled(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence whose prompt was prefilled in a step just launched (its first token is being sampled)."""
    s = Sequence(seq_id, "r", tokens, PARAMS)
    bm.allocate(s)
    s.num_computed_tokens = len(tokens)
    s.token_ids.append(UNKNOWN_TOKEN)
    return s


def child_of(parent: Sequence, seq_id: int) -> Sequence:
    child = Sequence(seq_id, "r", list(parent.prompt_token_ids), PARAMS, sample_index=seq_id)
    child.token_ids = list(parent.token_ids)
    return child


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = prefilled(bm, 0, list(range(10)))  # blocks: [0..3] [4..7] [8, 9] (partial)
    children = [child_of(parent, i) for i in (1, 2, 3)]
    copies = [bm.fork(parent, c) for c in children]
    full = parent.block_table[:2]
    for child, copy in zip(children, copies, strict=True):
        assert child.block_table[:2] == full
        assert copy == (parent.block_table[2], child.block_table[2])
        assert child.num_computed_tokens == 10
    assert [bm.blocks[b].ref_count for b in full] == [4, 4]  # the parent and three children
    assert bm.blocks[parent.block_table[2]].ref_count == 1
    assert len({c.block_table[2] for c in children} | {parent.block_table[2]}) == 4  # a copy each
    assert bm.num_free_blocks == 10 - 3 - 3
    # Each child then grows on its own: its next token goes to its own copy, the one after to a fresh block.
    for child in children:
        bm.append(child, 1)
    assert bm.num_free_blocks == 4
    for s in [parent, *children]:
        bm.free(s)
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_fork_on_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = prefilled(bm, 0, list(range(8)))
    child = child_of(parent, 1)
    assert bm.fork(parent, child) is None
    assert child.block_table == parent.block_table
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    bm.append(child, 1)  # the next token opens a block of the child's own
    assert len(child.block_table) == 3 and child.block_table[2] not in parent.block_table


def test_can_fork_needs_a_free_block_only_for_a_partial_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    partial = prefilled(bm, 0, list(range(10)))  # all three blocks
    assert not bm.can_fork(partial)
    bm.free(partial)
    boundary = prefilled(bm, 1, list(range(8)))
    bm.allocate(Sequence(2, "x", [50, 51], PARAMS))  # the last free block
    assert bm.can_fork(boundary)


def request(seq: Sequence) -> EngineRequest:
    return EngineRequest(seq, None, None, 100)  # type: ignore[arg-type]  # no text needed here


def test_forks_join_followers_when_the_leader_samples():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerLimits(8, 64), bm)
    forks = Forks(bm, scheduler)
    leader = request(Sequence(0, "r", list(range(6)), PARAMS))
    followers = [request(Sequence(i, "r", list(range(6)), PARAMS, sample_index=i)) for i in (1, 2)]
    forks.add(leader, followers)
    other = request(Sequence(9, "o", [1, 2, 3], PARAMS))
    scheduler.add(other.seq)
    scheduler.add(leader.seq)
    out = scheduler.schedule()
    pending = [PendingToken(r, len(r.seq.token_ids)) for r in (other, leader)]
    scheduler.on_step_launched(out)
    forked = forks.join(pending)
    assert forked is not None and not forks
    assert forked.rows == [1, 1]  # both repeat the leader's row
    assert [p.token_index for p in forked.pending] == [6, 6]
    assert len(forked.copies) == 2
    for f in followers:
        assert f.seq.status is SequenceStatus.RUNNING and f.seq in scheduler.running
        assert f.seq.token_ids == leader.seq.token_ids and f.seq.token_ids[-1] == UNKNOWN_TOKEN
    assert forks.join(pending) is None  # once only


def test_a_follower_without_a_block_for_its_copy_prefills_on_its_own():
    bm = BlockManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(SchedulerLimits(8, 64), bm)
    forks = Forks(bm, scheduler)
    leader = request(Sequence(0, "r", list(range(6)), PARAMS))  # both blocks, the second partial
    follower = request(Sequence(1, "r", list(range(6)), PARAMS, sample_index=1))
    forks.add(leader, [follower])
    scheduler.add(leader.seq)
    out = scheduler.schedule()
    pending = [PendingToken(leader, 6)]
    scheduler.on_step_launched(out)
    forked = forks.join(pending)
    assert forked is not None and forked.rows == [] and forked.copies == []
    assert list(scheduler.waiting) == [follower.seq] and follower.seq.token_ids == list(range(6))


def test_seeded_samples_differ_by_their_index():
    seeded = SamplingParams(seed=2**64 - 1)
    assert sample_params(seeded, 0) is seeded
    assert sample_params(seeded, 1).seed == 0  # wraps within the sampler's range
    assert sample_params(SamplingParams(seed=7), 3).seed == 10
    assert sample_params(PARAMS, 3) is PARAMS
