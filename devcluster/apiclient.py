"""A few admin GETs used while bringing a cluster up (plain HTTPS; importing the kubernetes client costs seconds)."""

import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tidal.devcluster.health import tail
from tidal.devcluster.layout import StateLayout
from tidal.devcluster.plan import ADMIN


class AdminHttp:
    def __init__(self, server: str, layout: StateLayout) -> None:
        ctx = ssl.create_default_context(cafile=str(layout.cert("ca")))
        ctx.load_cert_chain(str(layout.cert(ADMIN.file_name)), str(layout.key(ADMIN.file_name)))
        self._server = server
        self._ctx = ctx

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(verify=self._ctx, timeout=5.0) as client:
            return client.get(self._server + path)

    def readyz(self) -> tuple[bool, str]:
        try:
            response = self.get("/readyz")
        except httpx.HTTPError as exc:
            return False, str(exc)
        return response.status_code == 200, response.text[:300]

    def wait_node_ready(self, name: str, deadline: float, is_running: Callable[[], bool], log: Path) -> None:
        last = "not registered"
        while time.monotonic() < deadline:
            response = self.get(f"/api/v1/nodes/{name}")
            if response.status_code == 200:
                conditions = response.json().get("status", {}).get("conditions", [])
                ready = [c for c in conditions if c.get("type") == "Ready"]
                if ready and ready[0].get("status") == "True":
                    return
                last = f"Ready condition: {ready}"
            if not is_running():
                raise RuntimeError(f"the node agent exited during startup; last lines of {log}:\n{tail(log)}")
            time.sleep(0.1)
        raise TimeoutError(f"node {name} not Ready in time ({last}); last lines of {log}:\n{tail(log)}")

    def wait_service_account(self, namespace: str, name: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}").status_code == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"ServiceAccount {namespace}/{name} not created in time (is the controller-manager up?)")
