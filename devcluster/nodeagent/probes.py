"""Container probes: the timing/threshold bookkeeping (pure) and one probe attempt (I/O: HTTP, TCP, exec)."""

import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class ProbeSpec:
    kind: str  # "startup" | "liveness" | "readiness"
    handler: dict[str, Any]  # the httpGet / tcpSocket / exec / grpc part of the probe
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def from_container(cls, container: dict[str, Any], kind: str) -> "ProbeSpec | None":
        probe = container.get(f"{kind}Probe")
        if not probe:
            return None
        handler = {k: v for k, v in probe.items() if k in ("httpGet", "tcpSocket", "exec", "grpc")}
        return cls(
            kind=kind,
            handler=handler,
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


class ProbeTracker:
    """One probe of one container run: when it is due and what its thresholds make of the results so far.

    Readiness starts failed, liveness and startup start "not failed" (a missing result never kills a container).
    """

    def __init__(self, spec: ProbeSpec, container_started_at: float) -> None:
        self.spec = spec
        self.next_due = container_started_at + spec.initial_delay_s
        self.successes = 0
        self.failures = 0
        self.succeeded = False  # threshold of successes reached at least once since the last failure streak
        self.failed = False  # threshold of failures reached
        self.last_message = ""

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, ok: bool, message: str, now: float) -> None:
        self.next_due = now + self.spec.period_s
        self.last_message = message
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= self.spec.success_threshold:
                self.succeeded, self.failed = True, False
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= self.spec.failure_threshold:
                self.failed, self.succeeded = True, False


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"probe names port {port!r}, which the container does not declare")


def run_probe(spec: ProbeSpec, container: dict[str, Any], pod_ip: str, env: dict[str, str]) -> tuple[bool, str]:
    """One attempt against the container at pod_ip; (ok, message)."""
    handler = spec.handler
    try:
        if "httpGet" in handler:
            return _http(handler["httpGet"], container, pod_ip, spec.timeout_s)
        if "tcpSocket" in handler:
            port = resolve_port(handler["tcpSocket"]["port"], container)
            with socket.create_connection((handler["tcpSocket"].get("host") or pod_ip, port), spec.timeout_s):
                return True, ""
        if "exec" in handler:
            result = subprocess.run(
                handler["exec"]["command"], env=env, capture_output=True, timeout=spec.timeout_s, check=False
            )
            return result.returncode == 0, result.stdout.decode(errors="replace")[-300:]
    except (OSError, ValueError, subprocess.TimeoutExpired, httpx.HTTPError) as exc:
        return False, f"{spec.kind} probe failed: {type(exc).__name__}: {exc}"
    return False, f"{spec.kind} probe kind {sorted(handler)} is not supported by the node agent"


def _http(get: dict[str, Any], container: dict[str, Any], pod_ip: str, timeout_s: float) -> tuple[bool, str]:
    scheme = get.get("scheme", "HTTP").lower()
    host = get.get("host") or pod_ip
    port = resolve_port(get["port"], container)
    path = get.get("path", "/")
    if not path.startswith("/"):
        path = "/" + path
    headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
    headers.setdefault("User-Agent", "kube-probe/tidal-node-agent")
    # Like the kubelet: HTTPS probes do not verify certificates, redirects are followed, 200-399 is success.
    with httpx.Client(verify=False, timeout=timeout_s, follow_redirects=True) as client:
        response = client.get(f"{scheme}://{host}:{port}{path}", headers=headers)
    ok = 200 <= response.status_code < 400
    return ok, "" if ok else f"HTTP probe failed with statuscode: {response.status_code}"
