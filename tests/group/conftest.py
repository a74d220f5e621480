"""Rank processes for the group tests, always killed at the end of a test (even a failed one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from group_ranks import RankProcesses


@pytest.fixture
def start_ranks() -> Iterator[Callable[[int], RankProcesses]]:
    started: list[RankProcesses] = []

    def start(count: int) -> RankProcesses:
        ranks = RankProcesses()
        started.append(ranks)
        ranks.start(count)
        return ranks

    yield start
    for ranks in started:
        ranks.close()
