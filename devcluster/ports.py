"""Free loopback ports, so that any number of clusters can run side by side."""

import random
import socket

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


def choose_pod_subnet() -> int:
    """The third octet of this cluster's pod addresses (127.0.<subnet>.<n>); random so two clusters rarely share it."""
    return random.randint(1, 254)
