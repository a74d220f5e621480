"""Group membership by epochs (pure): newer epochs apply, a retry is a no-op, stale or foreign memberships are
refused with the reason."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.contract.control_api import GroupReconfigureRequest
from tidal.contract.error_codes import ErrorCode
from tidal.worker.lifecycle.errors import BadRequestError, StaleEpochError
from tidal.worker.lifecycle.membership import GroupMembership


def _request(epoch: int, ranks: list[int], leader: int = 0, group_size: int | None = None) -> GroupReconfigureRequest:
    members = [{"rank": r, "address": f"rank-{r}.group:29500"} for r in ranks]
    body = {"epoch": epoch, "members": members, "coordinator_rank": leader, "group_size": group_size}
    return GroupReconfigureRequest.model_validate(body)


def test_the_operator_protocol_all_then_survivors_then_all_again():
    group = GroupMembership(rank=1, world_size=3)
    assert (group.epoch, group.coordinator_rank, group.is_formed) == (0, 0, False)
    assert group.apply(_request(4, [0, 1, 2]))  # the first epoch the worker sees need not be 1
    assert (group.epoch, group.coordinator_rank, group.is_formed) == (4, 0, True)
    assert group.apply(_request(5, [1, 2], leader=1))  # rank 0 lost: degraded, not formed
    assert (group.epoch, group.coordinator_rank, group.is_formed) == (5, 1, False)
    assert group.apply(_request(6, [2, 0, 1]))
    assert (group.epoch, group.coordinator_rank, group.is_formed) == (6, 0, True)


def test_the_same_epoch_and_membership_again_is_a_retry():
    group = GroupMembership(rank=0, world_size=2)
    assert group.apply(_request(1, [0, 1]))
    assert not group.apply(_request(1, [1, 0]))  # member order does not matter
    assert group.epoch == 1


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (_request(2, [0, 1]), "older than epoch 3"),
        (_request(3, [0, 1, 2], leader=1), r"already applied with members \[0, 1, 2\], coordinator 0 and group_size 3"),
        (_request(3, [0, 1, 2], group_size=4), "already applied .* group_size 3"),
        (_request(3, [0, 1]), "a new membership needs a new epoch \\(> 3\\)"),
    ],
)
def test_stale_or_conflicting_epochs_are_refused_and_change_nothing(request_, match):
    group = GroupMembership(rank=0, world_size=3)
    group.apply(_request(3, [0, 1, 2]))
    with pytest.raises(StaleEpochError, match=match) as err:
        group.apply(request_)
    assert err.value.code == ErrorCode.STALE_EPOCH
    assert (group.epoch, group.coordinator_rank, group.is_formed) == (3, 0, True)


def test_a_membership_that_does_not_fit_this_worker_is_a_bad_request():
    group = GroupMembership(rank=1, world_size=3)
    with pytest.raises(BadRequestError, match="rank 1, which is not among the members \\[0, 2\\]"):
        group.apply(_request(1, [0, 2]))
    with pytest.raises(BadRequestError, match=r"ranks \[3\] are outside .* world_size 3"):
        group.apply(_request(1, [0, 1, 3]))
    assert group.epoch == 0 and group.current is None


def test_a_lone_rank_is_always_formed_and_the_schema_checks_the_coordinator():
    group = GroupMembership(rank=0, world_size=1)
    assert group.is_formed
    assert group.apply(_request(1, [0])) and group.is_formed
    with pytest.raises(ValidationError, match="coordinator_rank 2 is not one of the members"):
        _request(2, [0, 1], leader=2)
    with pytest.raises(ValidationError, match="duplicate ranks"):
        _request(2, [0, 0])


def test_the_group_size_is_each_epochs_grow_and_shrink():
    group = GroupMembership(rank=1, world_size=3)
    assert group.group_size == 3  # the start world_size before any epoch
    assert group.apply(_request(1, [0, 1, 2]))  # no group_size: the start world_size
    assert (group.group_size, group.is_formed) == (3, True)
    assert group.apply(_request(2, [0, 1, 2, 3], group_size=4))  # grown by rank 3, started for a group of 4
    assert (group.group_size, group.is_formed) == (4, True)
    assert group.apply(_request(3, [0, 1, 3], group_size=4))  # rank 2 lost: degraded
    assert (group.group_size, group.is_formed) == (4, False)
    assert group.apply(_request(4, [0, 1], group_size=2))  # shrunk to 2: whole again
    assert (group.group_size, group.is_formed) == (2, True)
    assert not group.apply(_request(4, [1, 0], group_size=2))  # a retry
    with pytest.raises(BadRequestError, match=r"ranks \[3\] are outside this worker's group of world_size 3"):
        group.apply(_request(5, [0, 1, 3]))  # without a group_size, the start world_size is the epoch's
    assert (group.epoch, group.group_size) == (4, 2)


def test_the_schema_checks_the_group_size_and_a_lone_worker_stays_alone():
    with pytest.raises(ValidationError, match=r"member ranks \[3, 4\] are outside a group of group_size 3"):
        _request(1, [0, 3, 4], group_size=3)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        _request(1, [0], group_size=0)
    alone = GroupMembership(rank=0, world_size=1)
    with pytest.raises(BadRequestError, match=r"started alone \(world_size 1\).*a group of 2") as err:
        alone.apply(_request(1, [0, 1], group_size=2))
    assert err.value.code == ErrorCode.INVALID_REQUEST and alone.current is None
    assert alone.apply(_request(1, [0], group_size=1)) and alone.is_formed
