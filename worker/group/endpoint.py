"""A rank's group endpoint: the key-value store (torch.distributed.TCPStore) it serves for its whole life.

It has two uses. The rank that coordinates an epoch hosts that epoch's rendezvous on it (under the epoch's own key
prefix, so a new epoch never reads an old one's keys), and peers probe it to tell a rank that is gone (the connection
is refused) from one that is frozen (the connection is accepted by the kernel but nobody answers). The store runs on
threads of its own, so it answers even while this rank's step is blocked in a collective.
"""

from __future__ import annotations

import datetime
import logging

from torch._C._distributed_c10d import TCPStore

log = logging.getLogger(__name__)


class GroupEndpoint:
    def __init__(self, host: str, port: int) -> None:
        """Listen on `port` (0: any free one; `address` says which)."""
        self.host = host
        self._store: TCPStore | None = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
        )
        self.port = self._store.port
        log.info("group endpoint listening on port %d", self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._store = None  # the server stops when the last reference goes
