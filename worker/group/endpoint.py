"""A rank's group endpoint: the key-value store (torch.distributed.TCPStore) it serves for its whole life.

It has two uses. The rank that coordinates an epoch hosts that epoch's rendezvous on it (under the epoch's own key
prefix, so a new epoch never reads an old one's keys), and peers probe it to tell a rank that is gone (the connection
is refused) from one that is frozen (the connection is accepted by the kernel but nobody answers). The store runs on
threads of its own, so it answers even while this rank's step is blocked in a collective.
"""

from __future__ import annotations

import datetime
import logging
import socket

from torch._C._distributed_c10d import TCPStore

log = logging.getLogger(__name__)


class GroupEndpoint:
    def __init__(self, host: str, port: int) -> None:
        """Listen on `host`:`port` (port 0: any free one; `address` says which). The socket is bound here and handed
        to the store: TCPStore binds every interface by itself, so two ranks whose pods share a node (each with its
        own IP, as the local control plane's node agent gives them) could not both use the group port."""
        self.host = host
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self.port: int = listener.getsockname()[1]
        # The store owns the socket from here on (it closes it when it goes), so Python lets go of it.
        self._store: TCPStore | None = TCPStore(
            host, self.port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30),
            master_listen_fd=listener.detach(),
        )  # fmt: skip
        log.info("group endpoint listening on %s:%d", host, self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._store = None  # the server stops, and its socket closes, when the last reference goes
