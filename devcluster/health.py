"""Waiting for components to become healthy (HTTP checks), without a Kubernetes client."""

import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tidal.devcluster.layout import StateLayout
from tidal.devcluster.plan import HealthCheck


def _ssl_context(check: HealthCheck, layout: StateLayout) -> ssl.SSLContext | bool:
    if not check.url.startswith("https://"):
        return False
    if check.client_cert is None:
        # The controller-manager and scheduler serve with a self-signed certificate they make at start; their
        # /healthz is unauthenticated and says nothing secret, so there is nothing to verify against.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    ctx = ssl.create_default_context(cafile=str(layout.cert("ca")))
    ctx.load_cert_chain(str(layout.cert(check.client_cert)), str(layout.key(check.client_cert)))
    return ctx


def probe(check: HealthCheck, layout: StateLayout, timeout_s: float = 2.0) -> tuple[bool, str]:
    """One attempt: (healthy, what was seen)."""
    try:
        with httpx.Client(verify=_ssl_context(check, layout), timeout=timeout_s) as client:
            response = client.get(check.url)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return response.status_code == 200, f"HTTP {response.status_code}: {response.text[:500]}"


def wait_healthy(
    name: str, check: HealthCheck, layout: StateLayout, deadline: float, is_running: Callable[[], bool], log: Path
) -> None:
    """Poll until healthy; fail fast (with the log's tail) if the process exits, or at the deadline."""
    last = "not probed yet"
    while time.monotonic() < deadline:
        ok, last = probe(check, layout)
        if ok:
            return
        if not is_running():
            raise RuntimeError(f"{name} exited during startup; last lines of {log}:\n{tail(log)}")
        time.sleep(0.1)
    raise TimeoutError(f"{name} not healthy in time ({check.url}: {last}); last lines of {log}:\n{tail(log)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
