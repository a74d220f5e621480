"""Leader election with a coordination.k8s.io Lease, so two operator replicas never reconcile at once.

The standby polls the Lease and takes it once its holder stopped renewing for `lease_seconds`. Expiry is judged the
way client-go does it: by how long *this* process has seen the Lease unchanged (local monotonic clock), never by
comparing another machine's timestamps. The leader renews every third of the duration; if it cannot renew before the
Lease would expire it must stop acting at once (the caller exits the process, and Kubernetes restarts it as a standby).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("tidal.operator.lease")


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(
        self,
        coordination: client.CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Any: every call sends and receives plain JSON (dict bodies, _preload_content=False), which the client's
        # annotations (V1Lease in, V1Lease out) do not describe.
        self._api: Any = coordination
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._seen: tuple[str | None, str | None] | None = None  # (holder, renewTime) last read
        self._seen_at = 0.0
        self._stop = threading.Event()

    # -- one attempt -------------------------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """One read-modify-write of the Lease; True when this process holds it afterwards."""
        try:
            lease = json.loads(self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False).data)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._create()
        spec = lease.get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
        now = self._clock()
        if self._seen != (holder, renewed):
            self._seen, self._seen_at = (holder, renewed), now
        expired = now - self._seen_at >= float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        if holder and holder != self.identity and not expired:
            return False
        stamp = _micro_time()
        if holder != self.identity:
            spec["acquireTime"] = stamp
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=int(self.lease_seconds), renewTime=stamp)
        lease["spec"] = spec
        try:
            # resourceVersion in the body makes this a compare-and-swap: a competitor's write makes it fail (409).
            self._api.replace_namespaced_lease(self.name, self.namespace, lease, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def _create(self) -> bool:
        stamp = _micro_time()
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_seconds),
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        try:
            self._api.create_namespaced_lease(self.namespace, body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    # -- loops -------------------------------------------------------------------------------------------------
    def wait_for_leadership(self, on_attempt: Callable[[bool], None] = lambda _: None) -> bool:
        """Block until this process holds the Lease (True) or `stop()` was called (False)."""
        announced = False
        while not self._stop.is_set():
            try:
                held = self.try_acquire_or_renew()
            except Exception as exc:  # the API may be briefly unreachable; keep trying
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                held = False
            on_attempt(held)
            if held:
                log.info("leading: holding lease %s/%s as %s", self.namespace, self.name, self.identity)
                return True
            if not announced:
                log.info("standby: lease %s/%s is held by another operator; waiting", self.namespace, self.name)
                announced = True
            self._stop.wait(max(1.0, self.lease_seconds / 5))
        return False

    def keep_renewing(self, on_lost: Callable[[], None], on_renewed: Callable[[], None] = lambda: None) -> None:
        """Start a daemon thread that renews the Lease; `on_lost` runs once if it cannot be kept."""

        def loop() -> None:
            last_ok = self._clock()
            while not self._stop.wait(self.lease_seconds / 3):
                try:
                    ok = self.try_acquire_or_renew()
                except Exception as exc:
                    log.warning("renewing lease %s/%s: %s", self.namespace, self.name, exc)
                    ok = False
                if ok:
                    last_ok = self._clock()
                    on_renewed()
                    continue
                # Someone else holds it, or the API did not answer for so long that someone else may: stop acting.
                if not ok and (self._clock() - last_ok >= self.lease_seconds * 2 / 3 or self._held_by_other()):
                    log.error("lost lease %s/%s; stopping", self.namespace, self.name)
                    on_lost()
                    return

        threading.Thread(target=loop, name="lease-renewer", daemon=True).start()

    def _held_by_other(self) -> bool:
        return self._seen is not None and self._seen[0] not in (None, self.identity)

    def release(self) -> None:
        """Stop renewing and hand the Lease over at once (a standby takes it on its next poll)."""
        self._stop.set()
        try:
            lease = json.loads(self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False).data)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = None
            lease["spec"]["leaseDurationSeconds"] = 1
            self._api.replace_namespaced_lease(self.name, self.namespace, lease, _preload_content=False)
            log.info("released lease %s/%s", self.namespace, self.name)
        except Exception as exc:
            log.warning("releasing lease %s/%s: %s", self.namespace, self.name, exc)

    def stop(self) -> None:
        self._stop.set()
