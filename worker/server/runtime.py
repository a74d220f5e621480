"""The engine's lifecycle as the HTTP layer sees it: loading -> ready (or failed) -> stopped.

The servers start listening before the model is loaded, so that `/health` answers at once and `/ready` says 503
until the engine can serve; Kubernetes then neither kills a pod that is still loading nor sends it traffic. The
loader is passed in: the composition root (`tidal.worker.process`) passes `LifecycleManager.load_engine`, which
builds the engine in memory the lifecycle can release; this module calls it on a worker thread, starts the engine's
step loop, and knows nothing of configuration.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidal.worker.server.errors import ApiError

if TYPE_CHECKING:
    from tidal.worker.engine.async_engine import AsyncEngine
    from tidal.worker.engine.outputs import EngineStats

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class WorkerRuntime:
    def __init__(self, load_engine: Callable[[], AsyncEngine]) -> None:
        self._load_engine = load_engine
        self.engine: AsyncEngine | None = None
        self.phase = Phase.LOADING
        self.failure: str | None = None
        # Called once the engine is loaded and started, before the worker reports ready (nothing is served yet).
        self.on_loaded: list[Callable[[], None]] = []

    @property
    def is_ready(self) -> bool:
        # A step loop that died leaves a loaded model that serves nothing: not ready, and not alive either.
        return self.phase is Phase.READY and self.engine is not None and self.engine.is_running

    @property
    def is_alive(self) -> bool:
        return self.phase is not Phase.READY or self.is_ready

    @property
    def served_model_name(self) -> str:
        return self.engine.model_name if self.engine is not None else ""

    async def load(self) -> None:
        """Build the engine off the event loop (it reads weights for a while), then start its step loop."""
        try:
            engine = await asyncio.to_thread(self._load_engine)
            await engine.start()
            for callback in self.on_loaded:
                callback()
        except Exception as exc:
            self.phase = Phase.FAILED
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("loading the model failed")
            raise
        self.engine = engine
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
            log.info("model %s ready (context %d tokens)", self.served_model_name, engine.max_model_len)

    async def shutdown(self) -> None:
        self.phase = Phase.STOPPED
        if self.engine is not None:
            await self.engine.shutdown()

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 that says why it cannot serve."""
        if self.engine is None or not self.is_ready:
            reason = {
                Phase.LOADING: "the model is still loading",
                Phase.STOPPED: "the server is shutting down",
                Phase.READY: "the engine loop has stopped",
            }.get(self.phase, f"the model failed to load: {self.failure}")
            raise ApiError(503, reason, code="not_ready")
        return self.engine

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None and self.phase is not Phase.STOPPED else None
