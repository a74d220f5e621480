"""A deadline on a rendezvous that torch's store client cannot outlive: a trainer's group, an epoch's group.

torch's TCPStore client bounds its connect by its timeout (a port that drops SYNs fails in time), but not the
reads that follow: the constructor's ping, and the answers to `add`, to `get` and to a cancelled `wait`, are read
with no deadline. A port that accepts and never answers (a frozen trainer or coordinator, or another service's port
that waits for its client to speak first) holds the joining thread forever, and with it the update or the epoch.
The client takes neither a socket of ours nor a read timeout, and a thread given up on would stay blocked, its store
live, for as long as the port stays silent. So at the deadline the process's connections to the rendezvous are shut
down from outside: the blocked read returns, torch raises, and the join ends with nothing left behind.

Only the connections of the call under the deadline are cut: those opened inside the block, or the ones named
(`only`: a store client's, recorded when it was made). Other connections to the same endpoint are another
epoch's store, maybe the serving one, which a cut would break on a healthy coordinator. And the deadline covers
what has no timeout of its own (the client's construction, a read), never the backend's setup: gloo waits on each
member with its own timeout, so members arriving one after another may take longer than one timeout in all while
nothing is wrong.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from types import TracebackType

# A client that retries its connect may open a new connection after a cut, until it sees its own deadline.
_RECUT_INTERVAL_S = 0.05
# torch's own timeouts end a few milliseconds past the call's (its waits begin once connected), with their own errors
# (a member missing); only a call still blocked a second later is taken for a store that never answers.
_UNANSWERED_GRACE_S = 1.0


class RendezvousDeadline(threading.Thread):
    """Within `with`: once the call's `timeout_s` and a grace pass, keep shutting down this process's TCP connections to
    (address, port) that were opened inside the block (or, given `only`, those of these socket ids) until the block
    ends. `cut` says whether any was, i.e. whether the call was broken by it; `opened()` lists the block's own."""

    def __init__(self, address: str, port: int, timeout_s: float, only: frozenset[str] | None = None) -> None:
        super().__init__(name=f"tidal-rendezvous-deadline-{port}", daemon=True)
        self.address, self.port, self.deadline_s = address, port, timeout_s + _UNANSWERED_GRACE_S
        self.cut = False
        self._only = only
        self._before: frozenset[str] = frozenset()
        self._ended = threading.Event()

    def __enter__(self) -> RendezvousDeadline:
        self._before = frozenset(_socket_ids())
        self.start()
        return self

    def opened(self) -> frozenset[str]:
        """The ids of this process's sockets opened since the block began (a store client's connections, when
        the block only made one): what a later deadline on that client's reads may cut."""
        return frozenset(_socket_ids()) - self._before

    def _targets(self, socket_id: str) -> bool:
        return socket_id in self._only if self._only is not None else socket_id not in self._before

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._ended.set()
        self.join()  # promptly: it only waits on `_ended` between cuts; after this, `cut` no longer changes

    def run(self) -> None:
        if self._ended.wait(self.deadline_s):
            return
        try:
            peers = _addresses_of(self.address, self.port)
        except OSError:  # unresolvable now: the client, which resolves the same name, cannot be connected either
            return
        while True:
            for conn in _connections_to(peers, self.port, self._targets):
                self.cut = True  # before the shutdown: the join raises as soon as its read returns
                _shut_down(conn)
            if self._ended.wait(_RECUT_INTERVAL_S):
                return


def _addresses_of(address: str, port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    return {_unmapped(str(info[4][0])) for info in infos}


def _unmapped(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """torch connects over IPv6 where it can, so an IPv4 peer may read as ::ffff:a.b.c.d."""
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _socket_ids() -> dict[str, str]:
    """This process's sockets: {"socket:[inode]": its descriptor's number} (Linux: /proc). The inode names the
    connection itself, whichever descriptor holds it, and no later socket reuses it while this one is open."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                found[target] = name
    return found


def _connections_to(
    peers: set[ipaddress.IPv4Address | ipaddress.IPv6Address], port: int, wanted: Callable[[str], bool]
) -> list[socket.socket]:
    """Duplicates of this process's TCP sockets whose peer is one of `peers` at `port`, of the ids `wanted` takes."""
    found = []
    for socket_id, name in _socket_ids().items():
        if not wanted(socket_id):
            continue
        try:
            conn = socket.socket(fileno=os.dup(int(name)))
            same = os.readlink(f"/proc/self/fd/{conn.fileno()}") == socket_id  # not a number reused since
        except (OSError, ValueError):  # closed since the listing, or not a socket after all
            continue
        if same and conn.type == socket.SOCK_STREAM and conn.family in (socket.AF_INET, socket.AF_INET6):
            try:
                host, peer_port = conn.getpeername()[:2]
                if peer_port == port and _unmapped(host) in peers:
                    found.append(conn)
                    continue
            except (OSError, ValueError):  # not connected (yet, or any more)
                pass
        conn.close()
    return found


def _shut_down(conn: socket.socket) -> None:
    """Shut down the connection itself (every descriptor of it), then close our duplicate."""
    with conn, contextlib.suppress(OSError):  # OSError: already closed by its peer or by torch
        conn.shutdown(socket.SHUT_RDWR)
