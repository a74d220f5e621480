"""Free loopback ports, so that any number of clusters can run side by side."""

import random
import socket
import struct
from pathlib import Path

from tidal.devcluster.plan import Ports


def free_ports(count: int) -> list[int]:
    """Ask the kernel for `count` distinct free ports (all sockets held until every port is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def allocate_ports() -> Ports:
    etcd_client, etcd_peer, apiserver, controller_manager, scheduler = free_ports(5)
    return Ports(etcd_client, etcd_peer, apiserver, controller_manager, scheduler)


def busy_loopback_subnets(proc_net_tcp: str) -> set[int]:
    """Third octets of 127.0.x.y addresses that have listening TCP sockets (from /proc/net/tcp's text)."""
    busy = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
            continue
        address = socket.inet_ntoa(struct.pack("<I", int(fields[1].split(":")[0], 16)))
        first, second, third, _ = address.split(".")
        if first == "127" and second == "0":
            busy.add(int(third))
    return busy


def choose_pod_subnet() -> int:
    """The third octet of this cluster's pod addresses (127.0.<subnet>.<n>): random among those where nothing
    listens yet, so clusters running side by side (other test sessions, a demo) rarely share pod addresses."""
    try:
        busy = busy_loopback_subnets(Path("/proc/net/tcp").read_text())
    except OSError:
        busy = set()
    free = [octet for octet in range(1, 255) if octet not in busy]
    return random.choice(free or list(range(1, 255)))
