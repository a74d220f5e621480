"""Probes and metrics: `/health` (the process answers; 503 once the step loop has died), `/ready` (the model can
serve), `/metrics` (Prometheus)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.runtime import WorkerRuntime


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def probe_router(runtime: WorkerRuntime, metrics: WorkerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health", responses={503: _json("the step loop has died: only a restart helps")})
    async def health() -> JSONResponse:
        # Liveness: a pod that is still loading its weights is alive and must not be restarted; one whose step loop
        # died serves nothing ever again, and only a restart helps.
        alive = runtime.is_alive
        body = {"status": "ok" if alive else "engine loop stopped", "phase": runtime.phase.value}
        return JSONResponse(body, status_code=200 if alive else 503)

    @router.get("/ready", responses={503: _json("loading, failed, or waiting for its group's epoch: `reason` says")})
    async def ready() -> JSONResponse:
        # Asleep is ready: the Service keeps the pod, so a request gets the worker's own answer (503 with
        # Retry-After, or a wake under TIDAL_ASLEEP_REQUESTS=wake) instead of a refused connection, and the wake
        # setting works at all. The operator reads sleep from the control API, not from readiness.
        body: dict[str, str | None] = {"phase": runtime.phase.value}
        if runtime.failure is not None:
            body["reason"] = runtime.failure
        ready = runtime.is_ready
        # A rank of an expert-parallel group with no working epoch holds the requests it gets: not ready, so that
        # the Service sends new ones to ranks that can serve them now.
        waiting = runtime.engine.serving_problem() if ready and runtime.engine is not None else None
        if waiting is not None:
            body["reason"], ready = waiting, False
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    return router
