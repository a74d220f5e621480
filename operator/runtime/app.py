"""The operator's long-lived parts, assembled once: API clients, the worker fleet, the reconcile queue, metrics."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from kubernetes import client

from tidal.operator.config import OperatorConfig
from tidal.operator.health import Health
from tidal.operator.kube.client import KubeApi
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.runtime.queue import Key, ReconcileQueue
from tidal.operator.runtime.reconcile import Reconciler
from tidal.operator.runtime.workers import WorkerFleet

HEARTBEAT_S = 10.0


class OperatorApp:
    def __init__(
        self, config: OperatorConfig, api_client: client.ApiClient, metrics: OperatorMetrics, health: Health
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.health = health
        self._api_client = api_client
        self._http: httpx.AsyncClient | None = None
        self._kube: KubeApi | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self.reconciler: Reconciler | None = None
        self.queue = ReconcileQueue(self._reconcile)

    async def start(self) -> None:
        """Inside kopf's event loop (the HTTP client must belong to it)."""
        # Keep-alive connections to hundreds of ranks are not worth keeping; each pass opens what it needs.
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
        self._kube = kube = KubeApi(self._api_client, reporting_instance=self.config.pod_name)
        fleet = WorkerFleet(self._http, self.metrics)
        self.reconciler = Reconciler(kube, fleet, self.metrics, self.config, self.queue.schedule)
        self._heartbeat = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            self.health.beat("leader")
            await asyncio.sleep(HEARTBEAT_S)

    async def _reconcile(self, key: Key, asked_at: float) -> float | None:
        if self.reconciler is None:
            return self.config.resync_seconds
        return await self.reconciler(key, asked_at)

    def forget(self, key: Key) -> None:
        self.queue.forget(key)
        if self.reconciler is not None:
            self.reconciler.forget(key)

    async def stop(self) -> None:
        await self.queue.close()
        if self.reconciler is not None:
            self.reconciler.memories.stop()  # reconfigure calls still running
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._http is not None:
            await self._http.aclose()
        if self._kube is not None:
            self._kube.close()
