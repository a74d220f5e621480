"""An epoch's collectives and store between real processes over gloo on loopback."""

from __future__ import annotations

import torch
from group_ranks import ok, rows_for


def test_the_step_header_reaches_every_member_in_member_order(start_ranks):
    ranks = start_ranks(4)
    ok(ranks.join(epoch=1, ranks=[0, 1, 2, 3], coordinator=2))
    headers = ok(ranks.run("gather", {r: (1, [r, r * 10, 7]) for r in range(4)}))
    assert headers == {r: [[m, m * 10, 7] for m in range(4)] for r in range(4)}


# rows sent by member i to member j: none from rank 0, none to rank 3, one pair with many rows
COUNTS = [
    [0, 0, 0, 0],
    [2, 1, 5, 0],
    [1, 0, 3, 0],
    [4, 9, 0, 0],
]


def test_all_to_all_moves_uneven_rows_of_any_shape_and_dtype(start_ranks):
    ranks = start_ranks(4)
    ok(ranks.join(epoch=1, ranks=[0, 1, 2, 3], coordinator=0))
    for trailing, dtype in [([2, 3], torch.float32), ([], torch.int64), ([4], torch.int32), ([5], torch.bfloat16)]:
        name = str(dtype).removeprefix("torch.")
        replies = ok(ranks.run("exchange", {r: (1, COUNTS[r], trailing, name) for r in range(4)}))
        for dst, (recv_counts, received) in replies.items():
            assert recv_counts == [COUNTS[src][dst] for src in range(4)]
            expected = torch.cat([rows_for(src, dst, COUNTS[src][dst], trailing, dtype) for src in range(4)])
            assert received == expected.to(torch.float64).tolist(), (dst, dtype)


def test_an_empty_step_exchanges_zero_rows(start_ranks):
    ranks = start_ranks(3)
    ok(ranks.join(epoch=1, ranks=[0, 1, 2], coordinator=0))
    replies = ok(ranks.run("exchange", {r: (1, [0, 0, 0], [8], "float32") for r in range(3)}))
    assert replies == {r: ([0, 0, 0], []) for r in range(3)}


def test_the_coordinator_publishes_and_every_member_fetches(start_ranks):
    ranks = start_ranks(3)
    ok(ranks.join(epoch=4, ranks=[0, 1, 2], coordinator=1))
    ranks.send(0, "fetch", 4, "expert_map", 10.0)  # waits for the value to be published
    ok(ranks.run("publish", {1: (4, "expert_map", b'{"slots": [[0, 1]]}')}))
    assert ranks.reply(0).value == b'{"slots": [[0, 1]]}'
    assert ok(ranks.run("fetch", {r: (4, "expert_map", 1.0) for r in (1, 2)})) == {
        r: b'{"slots": [[0, 1]]}' for r in (1, 2)
    }


def test_fetching_what_nobody_published_fails_after_its_timeout(start_ranks):
    ranks = start_ranks(2)
    ok(ranks.join(epoch=1, ranks=[0, 1], coordinator=0))
    reply = ranks.run("fetch", {1: (1, "expert_map", 0.5)})[1]
    assert reply.kind == "broken", reply.value
    assert reply.value.peer_rank is None and "no 'expert_map' within 0.5s" in str(reply.value)
    assert 0.5 <= reply.seconds < 5.0
