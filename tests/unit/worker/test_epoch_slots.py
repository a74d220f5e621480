"""Every member of an epoch must have the same expert slots per rank (pure, with a store in memory): a joiner with
another count makes every member refuse the epoch, with a message naming both counts."""

from __future__ import annotations

import pytest

from tidal.contract.error_codes import ErrorCode
from tidal.worker.lifecycle.epoch_slots import agree_on_slots, slot_count_mismatch
from tidal.worker.lifecycle.errors import ExpertsUnavailableError


class MemoryStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def publish(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def fetch(self, key: str, timeout_s: float) -> bytes:
        return self.values[key]  # a missing key is a KeyError here (the epoch's group raises GroupBrokenError)


def test_equal_counts_agree_and_a_different_one_is_named_with_the_coordinators():
    assert slot_count_mismatch({0: 4, 1: 4, 2: 4}, 0) is None
    problem = slot_count_mismatch({0: 4, 1: 4, 3: 3, 2: 4}, 1)
    assert problem is not None
    assert "ranks [0, 1, 2] have 4, ranks [3] have 3" in problem
    assert "--expert-slots-per-rank 4 (the coordinator's, rank 1)" in problem


def test_every_member_refuses_an_epoch_with_a_joiner_of_another_slot_count():
    store = MemoryStore()
    slots = {0: 4, 1: 4, 2: 4, 3: 3}
    for rank, count in slots.items():  # all publish before anyone reads, as after the rendezvous
        store.publish(f"slots_per_rank/{rank}", str(count).encode())
    for rank, count in slots.items():
        with pytest.raises(ExpertsUnavailableError, match=r"epoch 7 refused: .*ranks \[3\] have 3") as err:
            agree_on_slots(store, 7, list(slots), rank, count, 0, timeout_s=1.0)
        assert err.value.code == ErrorCode.EXPERTS_UNAVAILABLE
    agree_on_slots(store, 7, [0, 1, 2], 1, 4, 0, timeout_s=1.0)  # without the joiner, they agree
