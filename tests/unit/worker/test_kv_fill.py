"""The thread that maps the rest of the KV cache after a wake: blocks join the pool only when all of it is mapped,
between steps; a failure leaves the first share serving and is reported."""

import contextlib
import threading
from collections.abc import Iterator

from tidal.worker.lifecycle.kv_fill import KVFill


class _KV:
    def __init__(self, fail: bool = False) -> None:
        self.num_blocks = 100
        self.usable_blocks = 10
        self.fail = fail
        self.may_finish = threading.Event()

    def restore_rest(self) -> None:
        self.may_finish.wait(5)
        if self.fail:
            raise RuntimeError("cuMemCreate failed: CUDA error 2 (out of memory)")
        self.usable_blocks = self.num_blocks


class _BlockManager:
    def __init__(self) -> None:
        self.num_usable = 10

    def set_num_usable(self, num_usable: int) -> None:
        self.num_usable = num_usable


class _Engine:
    def __init__(self) -> None:
        self.block_manager = _BlockManager()
        self.step_lock = threading.Lock()


def _between_steps(engine: _Engine):
    @contextlib.contextmanager
    def between_steps() -> Iterator[_Engine]:
        with engine.step_lock:  # as AsyncEngine.between_steps: no step runs meanwhile
            yield engine

    return between_steps


def test_the_rest_joins_the_block_pool_between_steps_once_mapped():
    kv, engine = _KV(), _Engine()
    fill = KVFill(kv, _between_steps(engine))
    with engine.step_lock:  # a step is running: the mapped blocks wait for it to end
        fill.start()
        kv.may_finish.set()
        while kv.usable_blocks != kv.num_blocks:
            pass
        assert fill.running and engine.block_manager.num_usable == 10
    fill.join()
    assert engine.block_manager.num_usable == 100
    assert fill.last_error is None and fill.last_seconds is not None and not fill.running


def test_a_failed_fill_keeps_serving_on_the_first_share():
    kv, engine = _KV(fail=True), _Engine()
    fill = KVFill(kv, _between_steps(engine))
    fill.start()
    kv.may_finish.set()
    fill.join()
    assert engine.block_manager.num_usable == 10
    assert "out of memory" in (fill.last_error or "") and fill.last_seconds is None


def test_nothing_to_do_when_the_cache_is_whole():
    kv, engine = _KV(), _Engine()
    kv.usable_blocks = kv.num_blocks
    fill = KVFill(kv, _between_steps(engine))
    fill.start()
    assert not fill.running and fill.last_seconds == 0.0
