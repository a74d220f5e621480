"""Client-side load balancing over a Service's ready endpoints: the devcluster's stand-in for kube-proxy.

The devcluster has no Service VIPs (no kube-proxy, no CNI), so a client that wants "the model's Service" reads what
kube-proxy would: the Service's EndpointSlices, kept current by the real controller-manager from the pods' readiness
and the Service's selector. `ServiceEndpoints` watches them; `BalancingTransport` is an httpx transport that sends
each connection attempt to the next ready endpoint, round robin, whatever host the URL names. Clients (the official
`openai` client included) are used unchanged, their own retries included: a retry is a new attempt and may land on
another endpoint, as it would through a ClusterIP.

Every attempt is recorded (which pod, when, how it ended), so a test can count the attempts that failed on a rank
and the requests that succeeded only after a retry. An attempt is tied to the request that made it through a
thread-local scope (`RequestScope`), since the sync openai client runs a request's attempts in the caller's thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes import client, watch

log = logging.getLogger("tidal.devcluster.service_endpoints")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 30


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    port: int


class ServiceEndpoints:
    """The ready endpoints of one Service port, from a watch on its EndpointSlices (a background thread)."""

    def __init__(self, api_client: client.ApiClient, namespace: str, service: str, port_name: str = "http") -> None:
        self._discovery = client.DiscoveryV1Api(api_client)
        self._namespace, self._service, self._port_name = namespace, service, port_name
        self._slices: dict[str, list[Endpoint]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"endpoints-{service}", daemon=True)
        self._thread.start()

    def ready(self) -> list[Endpoint]:
        with self._lock:
            return sorted({e for eps in self._slices.values() for e in eps}, key=lambda e: e.pod)

    def wait_for(self, pods: set[str], timeout_s: float) -> list[Endpoint]:
        """Block until the ready endpoints are exactly `pods`; TimeoutError with what they were."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while {e.pod for eps in self._slices.values() for e in eps} != pods:
                left = deadline - time.monotonic()
                if left <= 0:
                    now = sorted({e.pod for eps in self._slices.values() for e in eps})
                    raise TimeoutError(f"service {self._service}: endpoints {now}, waited for {sorted(pods)}")
                self._changed.wait(left)
        return self.ready()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        selector = f"{SERVICE_NAME_LABEL}={self._service}"
        while not self._stopped.is_set():
            try:
                listed = self._discovery.list_namespaced_endpoint_slice(self._namespace, label_selector=selector)
                with self._changed:
                    self._slices = {s.metadata.name: self._ready_of(s) for s in listed.items}
                    self._changed.notify_all()
                stream = watch.Watch().stream(
                    self._discovery.list_namespaced_endpoint_slice, self._namespace, label_selector=selector,
                    resource_version=listed.metadata.resource_version, timeout_seconds=WATCH_TIMEOUT_S,
                )  # fmt: skip
                for event in stream:
                    if self._stopped.is_set():
                        return
                    obj = event["object"]
                    with self._changed:
                        if event["type"] == "DELETED":
                            self._slices.pop(obj.metadata.name, None)
                        else:
                            self._slices[obj.metadata.name] = self._ready_of(obj)
                        self._changed.notify_all()
            except Exception:  # the API server restarted, or the watch expired: list again
                if not self._stopped.is_set():
                    log.debug("endpoint watch of %s restarting", self._service, exc_info=True)
                    time.sleep(0.2)

    def _ready_of(self, endpoint_slice: Any) -> list[Endpoint]:
        port = next((p.port for p in endpoint_slice.ports or [] if p.name == self._port_name), None)
        if port is None:
            return []
        out = []
        for ep in endpoint_slice.endpoints or []:
            ready = ep.conditions is not None and ep.conditions.ready
            if ready and ep.target_ref is not None:
                out.extend(Endpoint(ep.target_ref.name, address, port) for address in ep.addresses)
        return out


@dataclass
class Attempt:
    """One connection attempt of a request: where it went and how it ended ("ok", or the exception's class)."""

    pod: str
    started: float
    ended: float | None = None
    outcome: str = "pending"
    status: int | None = None

    @property
    def failed(self) -> bool:
        return self.outcome not in ("ok", "pending")


@dataclass
class RequestScope:
    """The attempts of the request being made in this thread (see the module docstring)."""

    attempts: list[Attempt] = field(default_factory=list)


_scope = threading.local()


class scoped_request:
    def __enter__(self) -> RequestScope:
        _scope.current = RequestScope()
        return _scope.current

    def __exit__(self, *_: object) -> None:
        _scope.current = None


class NoReadyEndpointsError(httpx.ConnectError):
    """What a ClusterIP with no endpoints gives a client: the connection is refused."""


class _RecordedStream(httpx.SyncByteStream):
    """The response body, recording in the attempt whether it was read to its end or cut."""

    def __init__(self, inner: httpx.SyncByteStream, attempt: Attempt) -> None:
        self._inner, self._attempt = inner, attempt

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._inner
        except Exception as exc:
            self._attempt.outcome, self._attempt.ended = type(exc).__name__, time.monotonic()
            raise
        self._attempt.outcome, self._attempt.ended = "ok", time.monotonic()

    def close(self) -> None:
        self._inner.close()


class BalancingTransport(httpx.BaseTransport):
    """Round robin over `endpoints.ready()`, one pick per attempt; the URL's host and port are replaced."""

    def __init__(self, endpoints: ServiceEndpoints) -> None:
        self._endpoints = endpoints
        self._inner = httpx.HTTPTransport()
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.attempts: list[Attempt] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        ready = self._endpoints.ready()
        pod = ready[next(self._turn) % len(ready)] if ready else None
        attempt = Attempt(pod.pod if pod else "", time.monotonic())
        with self._lock:
            self.attempts.append(attempt)
        scope: RequestScope | None = getattr(_scope, "current", None)
        if scope is not None:
            scope.attempts.append(attempt)
        if pod is None:
            attempt.outcome, attempt.ended = NoReadyEndpointsError.__name__, attempt.started
            raise NoReadyEndpointsError("the service has no ready endpoints", request=request)
        request.url = request.url.copy_with(host=pod.ip, port=pod.port)
        try:
            response = self._inner.handle_request(request)
        except Exception as exc:
            attempt.outcome, attempt.ended = type(exc).__name__, time.monotonic()
            raise
        attempt.status = response.status_code
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _RecordedStream(response.stream, attempt)
        return response

    def close(self) -> None:
        self._inner.close()
