"""Asking each peer's group endpoint whether it is there: to name the peer that broke a collective.

A collective that fails says little about who failed (a reset connection, or a deadline that passed while waiting
for everyone). A peer whose process is gone refuses a new connection at once; a frozen one (SIGSTOP, a hung host) has
its connection accepted by the kernel but never answers; a healthy peer answers, even if its own step is blocked,
since its store runs on threads of its own. The store's client does not bound its handshake by its timeout when the
server is frozen, so each probe runs on a daemon thread that is given up on at the deadline (it ends by itself once
the peer dies or resumes). A `RendezvousDeadline` would end it instead, but it cuts every connection of this process
to the peer's endpoint, and a probe's deadline is short (half a second): a peer slow rather than frozen would lose
this rank's live connections to its store too, a join in progress that it coordinates or the serving epoch's store
(which NCCL still uses to set up communicators), where a late probe thread costs nothing.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Sequence

from torch._C._distributed_c10d import TCPStore

from tidal.worker.group.members import EpochMember


def probe_peers(members: Sequence[EpochMember], my_rank: int, timeout_s: float) -> dict[int, str]:
    """rank -> why it seems gone, for every peer that does not answer within `timeout_s` (empty: all answer)."""
    probes = [_Probe(m, timeout_s) for m in members if m.rank != my_rank]
    for probe in probes:
        probe.start()
    for probe in probes:
        probe.join(timeout_s + 0.05)
    return {p.member.rank: why for p in probes if (why := p.verdict()) is not None}


class _Probe(threading.Thread):
    def __init__(self, member: EpochMember, timeout_s: float) -> None:
        super().__init__(name=f"tidal-probe-rank{member.rank}", daemon=True)
        self.member = member
        self.timeout_s = timeout_s
        self.problem: str | None = None
        self.answered = False

    def run(self) -> None:
        m = self.member
        try:
            socket.create_connection((m.host, m.port), timeout=self.timeout_s).close()
        except ConnectionRefusedError:
            self.problem = f"rank {m.rank} at {m.address} is gone (connection refused)"
            return
        except OSError as err:
            self.problem = f"rank {m.rank} at {m.address} cannot be reached: {err}"
            return
        try:  # the kernel accepted: does the process answer?
            timeout = datetime.timedelta(seconds=self.timeout_s)
            TCPStore(m.host, m.port, is_master=False, wait_for_workers=False, timeout=timeout).check(["tidal/probe"])
            self.answered = True
        except Exception as err:
            self.problem = f"rank {m.rank} at {m.address} fails to answer: {str(err).splitlines()[0][:200]}"

    def verdict(self) -> str | None:
        if self.answered:
            return None
        if self.problem is not None:
            return self.problem
        return f"rank {self.member.rank} at {self.member.address} does not answer within {self.timeout_s:g}s (frozen)"
