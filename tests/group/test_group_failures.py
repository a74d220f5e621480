"""A group's failures between real processes: a crashed peer (SIGKILL), a frozen one (SIGSTOP), a dead coordinator.

Times are measured in the ranks and checked with wide margins and orderings (a crash is seen long before the
deadline; a freeze no sooner than the deadline), never against tight bounds. The collective fails at once; naming
the peer to blame is `EpochGroup.find_culprit`'s probe, which the engine runs off the step path.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

import pytest
import torch
from group_ranks import HOST, ok

from tidal.worker.group.endpoint import GroupEndpoint
from tidal.worker.group.epoch_group import join_epoch
from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.group.members import EpochMember
from tidal.worker.group.probe import probe_peers
from tidal.worker.testing.silent_port import SilentPort

LONG_DEADLINE_S = 20.0


def test_a_killed_peer_fails_a_collective_at_once_and_the_probe_names_it(start_ranks):
    ranks = start_ranks(3)
    ok(ranks.join(epoch=1, ranks=[0, 1, 2], coordinator=0, timeout_s=LONG_DEADLINE_S))
    ok(ranks.run("gather", {r: (1, [r]) for r in range(3)}))
    ranks.kill(2)
    replies = ranks.run("exchange", {r: (1, [1, 1, 1], [4], "float32") for r in (0, 1)})
    for reply in replies.values():
        assert reply.kind == "broken", reply.value
        assert reply.value.epoch == 1 and "failed" in reply.value.reason, str(reply.value)
        assert reply.seconds < LONG_DEADLINE_S / 4
    culprits = ok(ranks.run("culprit", {r: (1,) for r in (0, 1)}))
    for peer, why in culprits.values():
        assert peer == 2 and why == f"rank 2 at {ranks.addresses[2]} is gone (connection refused)"


def test_a_frozen_peer_fails_a_collective_at_the_deadline_and_the_probe_names_it(start_ranks):
    ranks = start_ranks(3)
    deadline_s = 1.0
    ok(ranks.join(epoch=1, ranks=[0, 1, 2], coordinator=0, collective_timeout_s=deadline_s))
    ok(ranks.run("gather", {r: (1, [r]) for r in range(3)}))
    ranks.signal(2, signal.SIGSTOP)  # the fixture kills it at the end, stopped or not
    replies = ranks.run("gather", {r: (1, [r]) for r in (0, 1)})
    for reply in replies.values():
        assert reply.kind == "broken", reply.value
        assert deadline_s * 0.9 <= reply.seconds < deadline_s * 10
    culprits = ok(ranks.run("culprit", {r: (1,) for r in (0, 1)}))
    for peer, why in culprits.values():
        assert peer == 2 and "(frozen)" in why, why
    ok(ranks.run("close", {0: (1,), 1: (1,)}))  # closing a broken group does not wait for the frozen peer


def test_survivors_form_the_next_epoch_after_its_coordinator_was_killed(start_ranks):
    ranks = start_ranks(4)
    ok(ranks.join(epoch=1, ranks=[0, 1, 2, 3], coordinator=0, timeout_s=LONG_DEADLINE_S))
    ok(ranks.run("publish", {0: (1, "expert_map", b"epoch 1")}))
    ranks.kill(0)
    survivors = [1, 2, 3]
    broken = ranks.run("gather", {r: (1, [r]) for r in survivors})
    assert all(reply.kind == "broken" for reply in broken.values())
    ok(ranks.run("close", {r: (1,) for r in survivors}))

    joined = ok(ranks.join(epoch=2, ranks=survivors, coordinator=2, timeout_s=LONG_DEADLINE_S))
    assert set(joined) == set(survivors)
    assert ok(ranks.run("gather", {r: (2, [r, 2]) for r in survivors})) == {
        r: [[1, 2], [2, 2], [3, 2]] for r in survivors
    }
    counts = {1: [0, 2, 1], 2: [3, 0, 0], 3: [1, 1, 0]}
    exchanged = ok(ranks.run("exchange", {r: (2, counts[r], [2], "float32") for r in survivors}))
    assert {r: recv_counts for r, (recv_counts, _) in exchanged.items()} == {1: [0, 3, 1], 2: [2, 0, 1], 3: [1, 0, 0]}
    ok(ranks.run("publish", {2: (2, "expert_map", b"epoch 2")}))
    assert ok(ranks.run("fetch", {r: (2, "expert_map", 5.0) for r in survivors})) == {r: b"epoch 2" for r in survivors}


def test_a_coordinator_that_accepts_and_never_answers_fails_the_join_in_time():
    # torch's store client bounds its connect by the timeout, not the ping that follows: a frozen coordinator held
    # the join, and the rank's preparation of the epoch, forever.
    with SilentPort() as silent:
        coordinator = f"{HOST}:{silent.port}"
        members = [EpochMember(0, coordinator), EpochMember(1, f"{HOST}:1")]  # rank 1's own endpoint is not used
        start = time.monotonic()
        with pytest.raises(GroupBrokenError) as caught:
            _returns_within(10.0, lambda: join_epoch(1, members, 1, 0, torch.device("cpu"), 1.0, 1.0))
        assert time.monotonic() - start < 5.0
        assert caught.value.epoch == 1 and caught.value.peer_rank == 0
        assert re.match(f"could not join: coordinator rank 0 at {re.escape(coordinator)} did not answer within 1s",
                        caught.value.reason), caught.value.reason  # fmt: skip
        # Nothing of the attempt stays connected: no store left that a coordinator waking up could still talk to.
        assert silent.accepted and silent.hung_up_by_clients(timeout_s=2.0)


def test_a_member_that_never_arrives_fails_the_join_with_torchs_own_timeout():
    # The deadline is for a store that never answers: a live coordinator's wait ends first, with torch's reason.
    coordinator, absent = GroupEndpoint(HOST, 0), GroupEndpoint(HOST, 0)
    try:
        members = [EpochMember(0, coordinator.address), EpochMember(1, absent.address)]
        with pytest.raises(GroupBrokenError) as caught:
            _returns_within(10.0, lambda: join_epoch(1, members, 0, 0, torch.device("cpu"), 1.0, 1.0))
        assert "did not answer" not in caught.value.reason and caught.value.peer_rank is None, caught.value.reason
    finally:
        coordinator.close()
        absent.close()


def test_a_frozen_coordinator_fails_its_store_reads_and_the_next_join_in_time(start_ranks):
    ranks = start_ranks(3)
    timeout_s, within_s = 1.0, 10.0  # without the deadline, each call blocks until the coordinator is killed
    ok(ranks.join(epoch=1, ranks=[0, 1, 2], coordinator=0, timeout_s=LONG_DEADLINE_S))
    ranks.signal(0, signal.SIGSTOP)  # the fixture kills it at the end, stopped or not
    survivors = [1, 2]
    # The epoch's store after the join (the slot counts, the expert map): its wait ends, the cancel's answer never.
    fetched = ranks.run("fetch", {r: (1, "expert_map", timeout_s) for r in survivors}, within_s=within_s)
    # An epoch sent before the freeze was seen, with the same coordinator.
    members = ranks.members([0, 1, 2])
    joined = ranks.run("join", {r: (2, members, r, 0, timeout_s, None) for r in survivors}, within_s=within_s)
    for reply in [*fetched.values(), *joined.values()]:
        assert reply.kind == "broken", reply.value
        assert reply.value.peer_rank == 0 and "coordinator rank 0" in reply.value.reason, str(reply.value)
        assert f"did not answer within {timeout_s:g}s" in reply.value.reason, str(reply.value)
        assert timeout_s * 0.9 <= reply.seconds < timeout_s + 5.0
    ok(ranks.run("close", {r: (1,) for r in survivors}))

    # Nothing of those attempts holds the survivors: the next epoch, without the frozen rank, forms and serves.
    ok(ranks.join(epoch=3, ranks=survivors, coordinator=1, timeout_s=LONG_DEADLINE_S))
    assert ok(ranks.run("gather", {r: (3, [r]) for r in survivors})) == {r: [[1], [2]] for r in survivors}


def test_members_arriving_one_after_another_join_and_the_serving_store_stays(start_ranks):
    # Each member arrives within the timeout of the one before, so the join takes longer than one timeout in all:
    # no deadline may take that for a frozen coordinator, nor cut the serving epoch's store, which the same
    # coordinator hosts.
    ranks = start_ranks(3)
    timeout_s = 2.0
    ok(ranks.join(epoch=1, ranks=[0, 1, 2], coordinator=0, timeout_s=LONG_DEADLINE_S))
    members = ranks.members([0, 1, 2])
    for rank in range(3):
        if rank:
            time.sleep(0.9 * timeout_s)
        ranks.send(rank, "join", 2, members, rank, 0, timeout_s, None)
    joined = {rank: ranks.reply(rank, LONG_DEADLINE_S) for rank in range(3)}
    ok(joined)
    assert joined[0].seconds > timeout_s + 1.0  # longer than the deadline's timeout and grace: the case at issue
    ok(ranks.run("publish", {r: (1, f"after-{r}", b"still") for r in range(3)}))
    assert ok(ranks.run("fetch", {r: (1, f"after-{(r + 1) % 3}", 5.0) for r in range(3)})) == {
        r: b"still" for r in range(3)
    }
    assert ok(ranks.run("gather", {r: (2, [r]) for r in range(3)})) == {r: [[0], [1], [2]] for r in range(3)}


def _returns_within(seconds: float, call: Callable[[], object]) -> object:
    """call(), failing the test instead of hanging it when it has not returned after `seconds`."""
    outcome: Future[object] = Future()

    def run() -> None:
        try:
            outcome.set_result(call())
        except BaseException as err:
            outcome.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    if not wait([outcome], seconds).done:
        pytest.fail(f"still blocked after {seconds:g}s")
    return outcome.result()


def test_the_probe_tells_a_live_peer_from_a_gone_and_a_frozen_one(start_ranks):
    ranks = start_ranks(3)
    me = GroupEndpoint(HOST, 0)
    try:
        members = [EpochMember(9, me.address)] + [EpochMember(r, a) for r, a in ranks.members([0, 1, 2])]
        assert probe_peers(members, 9, 0.5) == {}
        ranks.kill(1)
        ranks.signal(2, signal.SIGSTOP)
        found = probe_peers(members, 9, 0.5)
        assert sorted(found) == [1, 2]
        assert "gone (connection refused)" in found[1] and "(frozen)" in found[2]
    finally:
        me.close()
