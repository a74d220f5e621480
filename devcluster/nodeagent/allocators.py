"""Per-pod resources the node hands out: loopback addresses and GPU indices (thread-safe, no I/O).

Linux routes all of 127.0.0.0/8 to the loopback device, so 127.0.<subnet>.<n> needs no setup: a server bound to
its pod's address is reachable at that address from every local process, and two pods can both use port 8000.
"""

import threading
from typing import Any


class AddressPool:
    def __init__(self, subnet: int) -> None:
        self._prefix = f"127.0.{subnet}."
        self._lock = threading.Lock()
        self._by_uid: dict[str, str] = {}
        self._next = 1

    def owns(self, ip: str) -> bool:
        return ip.startswith(self._prefix)

    def assign(self, uid: str, wanted: str | None = None) -> str:
        """The pod's address; `wanted` (from the pod's status, after an agent restart) is kept when still free."""
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            used = set(self._by_uid.values())
            if wanted and self.owns(wanted) and wanted not in used:
                self._by_uid[uid] = wanted
                return wanted
            # Round robin, so an address just released (its port maybe in TIME_WAIT) is reused last.
            for step in range(254):
                host = (self._next - 1 + step) % 254 + 1
                ip = f"{self._prefix}{host}"
                if ip not in used:
                    self._next = host % 254 + 1
                    self._by_uid[uid] = ip
                    return ip
        raise RuntimeError(f"no free pod address left in {self._prefix}0/24")

    def release(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)


class GpuPool:
    def __init__(self, count: int) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._by_uid: dict[str, list[int]] = {}

    def assign(self, uid: str, wanted: int) -> list[int]:
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            taken = {i for ids in self._by_uid.values() for i in ids}
            free = [i for i in range(self._count) if i not in taken]
            if len(free) < wanted:
                raise RuntimeError(f"pod wants {wanted} nvidia.com/gpu, only {len(free)} of {self._count} are free")
            self._by_uid[uid] = free[:wanted]
            return self._by_uid[uid]

    def release(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)


def visible_devices(indices: list[int], agent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a container: the node's GPU indices, mapped through the agent's own list if it
    was started with one (so `CUDA_VISIBLE_DEVICES=2,3 tidal-devcluster up --gpus 2` hands out GPUs 2 and 3)."""
    host = [d.strip() for d in (agent_visible or "").split(",") if d.strip()]
    return ",".join(host[i] if i < len(host) else str(i) for i in indices)


def container_gpus(container: dict[str, Any]) -> int:
    """nvidia.com/gpu a container asks for (extended resources: the limit is the request)."""
    resources = container.get("resources", {})
    value = resources.get("limits", {}).get("nvidia.com/gpu") or resources.get("requests", {}).get("nvidia.com/gpu")
    return int(value or 0)


def gpu_request(pod: dict[str, Any]) -> int:
    return sum(container_gpus(c) for c in pod.get("spec", {}).get("containers", []))
