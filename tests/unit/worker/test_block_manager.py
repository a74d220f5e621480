"""BlockManager: allocation, growth, freeing and prefix caching, on plain sequences (no torch)."""

from __future__ import annotations

import pytest

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.sequence import Sequence

PARAMS = SamplingParams()


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, PARAMS)


def test_allocate_covers_all_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(0, list(range(10)))  # 10 tokens -> 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3
    assert len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.free(s)
    assert bm.num_free_blocks == 8
    assert s.block_table == []


def test_cannot_allocate_more_than_free():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(seq(0, list(range(9))))  # needs 3 blocks
    assert bm.can_allocate(seq(1, list(range(8))))


def test_append_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = seq(0, [1, 2, 3])
    bm.allocate(s)
    s.num_computed_tokens = 3
    s.append_token(4)
    assert bm.can_append(s, 1)
    bm.append(s, 1)  # token 4 fits block 0
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    s.append_token(5)
    bm.append(s, 1)  # token 5 needs a second block
    assert len(s.block_table) == 2
    assert bm.num_free_blocks == 2


def test_can_append_false_when_cache_full():
    bm = BlockManager(num_blocks=1, block_size=2)
    s = seq(0, [1, 2])
    bm.allocate(s)
    s.num_computed_tokens = 2
    s.append_token(3)
    assert not bm.can_append(s, 1)
    assert not bm.try_append(s, 1)
    assert s.block_table == [0]  # a refused try_append takes nothing
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        bm.append(s, 1)


def test_try_append_takes_every_block_a_chunk_needs():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    s = seq(0, list(range(7)))
    bm.allocate(s)  # 4 blocks for 7 tokens
    bm.free(s)
    s = seq(1, [1])
    bm.allocate(s)
    s.token_ids.extend(range(6))
    assert not bm.try_append(s, 7 + 2)  # 9 tokens need 4 more blocks: only 3 free
    assert s.block_table == [s.block_table[0]]
    assert bm.try_append(s, 7)  # 7 tokens need 3 more blocks
    assert len(s.block_table) == 4 and bm.num_free_blocks == 0


def test_prefix_hit_reuses_committed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, list(range(10)))
    bm.allocate(a)
    a.num_computed_tokens = 10
    bm.commit(a)  # two full blocks registered
    b = seq(1, [*range(8), 99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.num_prefix_hit_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_uncommitted_blocks_are_not_hits():
    """A block being written by a chunked prefill must not be shared before its K/V exist."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, list(range(10)))
    bm.allocate(a)
    a.num_computed_tokens = 4
    bm.commit(a)  # only block 0 is full and computed
    b = seq(1, list(range(10)))
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert b.num_computed_tokens == 4


def test_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(0, list(range(8)))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = seq(1, list(range(8)))  # identical prompt: the last block must be recomputed for its logits
    bm.allocate(b)
    assert b.num_computed_tokens == 4
    assert b.num_uncomputed_tokens == 4


def test_freed_cached_block_is_revived_until_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq(0, [1, 2, 3])
    bm.allocate(a)
    a.num_computed_tokens = 3
    bm.commit(a)
    cached_block = a.block_table[0]
    bm.free(a)
    assert bm.num_free_blocks == 3
    b = seq(1, [1, 2, 7])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[0] == cached_block and b.num_computed_tokens == 2
    bm.free(b)
    # Filling the cache with other tokens evicts it.
    c = seq(2, [5, 5, 5, 5, 5, 5])
    bm.allocate(c)
    d = seq(3, [1, 2, 7])
    bm.free(c)
    bm.allocate(d)
    assert d.num_computed_tokens == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.commit(a)
    b = seq(1, [1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
