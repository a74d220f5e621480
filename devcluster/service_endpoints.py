"""Client-side load balancing over a Service's ready endpoints: the devcluster's stand-in for kube-proxy.

The devcluster has no Service VIPs (no kube-proxy, no CNI), so a client that wants "the model's Service" picks its
endpoints itself, as kube-proxy would. It cannot read them from EndpointSlices: devcluster pods have loopback
addresses (127.0.x.y, see nodeagent/allocators.py), which the API server refuses in an EndpointSlice, so the
controller-manager's slices for them stay empty. `ServiceEndpoints` therefore applies the EndpointSlice controller's
rule itself, from the real objects: the pods the Service's selector matches that are Ready, not terminating and have
an IP, at the container port the Service's target port names. `BalancingTransport` is an httpx transport that sends
each connection attempt to the next ready endpoint, round robin, whatever host the URL names. Clients (the official
`openai` client included) are used unchanged, their own retries included: a retry is a new attempt and may land on
another endpoint, as it would through a ClusterIP.

Every attempt is recorded (which pod, when, how it ended), so a test can count the attempts that failed on a rank
and the requests that succeeded only after a retry. An attempt is tied to the request that made it through a
thread-local scope (`scoped_request`), since the sync openai client runs a request's attempts in the caller's thread.
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

WATCH_TIMEOUT_S = 30


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    port: int


def ready_endpoint(pod: Any, target_port: int | str) -> Endpoint | None:
    """The pod's endpoint for `target_port` (a number, or a container port's name) if the EndpointSlice controller
    would list it as ready: Ready condition True, not terminating, an IP, and the named port present."""
    if pod.metadata.deletion_timestamp is not None or not pod.status.pod_ip:
        return None
    if not any(cond.type == "Ready" and cond.status == "True" for cond in pod.status.conditions or []):
        return None
    if isinstance(target_port, int):
        return Endpoint(pod.metadata.name, pod.status.pod_ip, target_port)
    for container in pod.spec.containers:
        for port in container.ports or []:
            if port.name == target_port:
                return Endpoint(pod.metadata.name, pod.status.pod_ip, port.container_port)
    return None


class ServiceEndpoints:
    """The ready endpoints of one Service port, kept current by a watch on the pods its selector matches."""

    def __init__(self, api_client: client.ApiClient, namespace: str, service: str, port_name: str = "http") -> None:
        self._core = client.CoreV1Api(api_client)
        self._namespace, self._service = namespace, service
        svc: Any = self._core.read_namespaced_service(service, namespace)
        self._selector = ",".join(f"{k}={v}" for k, v in sorted((svc.spec.selector or {}).items()))
        port = next(p for p in svc.spec.ports if p.name == port_name)
        self._target_port: int | str = port.target_port if port.target_port is not None else port.port
        self._pods: dict[str, Endpoint] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"endpoints-{service}", daemon=True)
        self._thread.start()

    def ready(self) -> list[Endpoint]:
        with self._lock:
            return sorted(self._pods.values(), key=lambda e: e.pod)

    def wait_for(self, pods: set[str], timeout_s: float) -> list[Endpoint]:
        """Block until the ready endpoints are exactly `pods`; TimeoutError with what they were."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while set(self._pods) != pods:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"service {self._service}: endpoints {sorted(self._pods)}, waited for {sorted(pods)}"
                    )
                self._changed.wait(left)
        return self.ready()

    def stop(self) -> None:
        self._stopped.set()

    def _set(self, pod: Any) -> None:
        endpoint = ready_endpoint(pod, self._target_port)
        if endpoint is None:
            self._pods.pop(pod.metadata.name, None)
        else:
            self._pods[pod.metadata.name] = endpoint

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                listed: Any = self._core.list_namespaced_pod(self._namespace, label_selector=self._selector)
                with self._changed:
                    self._pods = {}
                    for pod in listed.items:
                        self._set(pod)
                    self._changed.notify_all()
                stream = watch.Watch().stream(
                    self._core.list_namespaced_pod, self._namespace, label_selector=self._selector,
                    resource_version=listed.metadata.resource_version, timeout_seconds=WATCH_TIMEOUT_S,
                )  # fmt: skip
                for event in stream:
                    if self._stopped.is_set():
                        return
                    pod = event["object"]
                    with self._changed:
                        if event["type"] == "DELETED":
                            self._pods.pop(pod.metadata.name, None)
                        else:
                            self._set(pod)
                        self._changed.notify_all()
            except Exception:  # the watch expired or the API server went away: list again
                if not self._stopped.is_set():
                    log.debug("endpoint watch of %s restarting", self._service, exc_info=True)
                    time.sleep(0.2)


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
        scope = RequestScope()
        _scope.current = scope
        return scope

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
