"""Blocks without memory behind them (a wake maps the KV cache's first share first) are never handed out."""

import pytest

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.sequence import Sequence


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(
        seq_id, f"r{seq_id}", list(range(100 + seq_id * 1000, 100 + seq_id * 1000 + num_tokens)), SamplingParams()
    )


def test_only_usable_blocks_are_handed_out_until_the_rest_is_back():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.set_num_usable(3)
    assert manager.num_free_blocks == 3 and manager.usage == 0.0
    first = _seq(0, 12)  # 3 blocks
    assert manager.can_allocate(first)
    manager.allocate(first)
    assert max(first.block_table) < 3 and manager.usage == 1.0
    assert not manager.can_allocate(_seq(1, 1))
    manager.set_num_usable(8)
    assert manager.num_free_blocks == 5
    second = _seq(1, 20)
    manager.allocate(second)
    assert sorted(second.block_table) == [3, 4, 5, 6, 7]


def test_taking_blocks_out_needs_them_unused_and_forgets_their_prefixes():
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = _seq(0, 8)
    manager.allocate(seq)
    with pytest.raises(RuntimeError, match="held by sequences"):
        manager.set_num_usable(2)
    seq.num_computed_tokens = 8
    manager.commit(seq)
    manager.free(seq)
    manager.set_num_usable(2)  # blocks 2 and 3 held cached prefixes
    again = _seq(0, 8)
    assert manager.num_free_blocks == 2 and not manager.can_allocate(again)
    manager.set_num_usable(4)
    manager.allocate(again)
    assert again.num_computed_tokens == 4  # the prefix in blocks 0-1 is still cached; 2-3's was forgotten


@pytest.mark.parametrize("bad", [0, 5])
def test_rejects_a_usable_count_outside_the_cache(bad):
    with pytest.raises(ValueError, match=r"num_usable must be in \[1, 4\]"):
        BlockManager(num_blocks=4, block_size=2).set_num_usable(bad)
