"""The KV cache's share of free GPU memory once the CUDA graphs' private pool is held back (kv_cache.py)."""

from tidal.worker.engine.kv_cache import kv_cache_budget, num_blocks_for_bytes

GIB = 2**30


def test_the_fraction_applies_to_what_the_graphs_leave():
    assert kv_cache_budget(100 * GIB, 0.9, 0) == int(90 * GIB)
    assert kv_cache_budget(100 * GIB, 0.9, 10 * GIB) == int(81 * GIB)
    assert kv_cache_budget(100 * GIB, 1.0, 2 * GIB) == 98 * GIB  # a full share still leaves the pool its room


def test_a_pool_larger_than_free_memory_leaves_no_cache_rather_than_a_negative_one():
    budget = kv_cache_budget(1 * GIB, 0.9, 3 * GIB)
    assert budget == 0
    assert num_blocks_for_bytes(budget, 2 * 2**20) == 0  # decide_num_kv_blocks turns this into a ModelLoadError
