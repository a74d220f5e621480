"""The worker process's composition root: config -> lifecycle manager -> runtime -> listeners, in one place.

The command line, the in-process test harness, the benchmarks and the tests all assemble a worker here, so they run
what production runs. Nothing is bound or loaded yet: `WorkerServers.run()` binds the listeners and loads the model
through the runtime, which calls `LifecycleManager.load_engine`: the manager picks the engine's memory provider
(releasable memory, so the lifecycle can sleep and update it), so the engine is always built by it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from tidal.worker.config import WorkerConfig
from tidal.worker.control import app as control_api
from tidal.worker.control.auth import resolve_control_token
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.lifecycle.metrics import LifecycleMetrics
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import Listener, WorkerServers, build_api_app, connection_limits
from tidal.worker.server.errors import connection_error_response
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.runtime import WorkerRuntime

if TYPE_CHECKING:
    from tidal.worker.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerProcess:
    config: WorkerConfig
    lifecycle: LifecycleManager
    servers: WorkerServers

    @property
    def runtime(self) -> WorkerRuntime:
        return self.servers.runtime


def assemble_worker(config: WorkerConfig, registry: CollectorRegistry | None = None) -> WorkerProcess:
    """Everything one worker serves, around one engine: the serving API always, the control API when a token is
    set. Raises ControlTokenError (a ValueError) for a token setting that is wrong."""
    registry = registry if registry is not None else CollectorRegistry()
    engine = config.engine
    lifecycle = LifecycleManager(config.lifecycle, LifecycleMetrics(registry), engine.rank, engine.world_size)
    server = config.server
    prompt_builder = PromptBuilder(server.tokenizer_threads, server.allow_request_chat_template)

    def load_engine() -> AsyncEngine:
        loaded = lifecycle.load_engine(engine)
        prompt_builder.token_floor(loaded.tokenizer)  # on the loading thread, so that no request waits for it
        return loaded

    runtime = WorkerRuntime(load_engine)
    metrics = WorkerMetrics(registry, runtime.stats)
    api_app = build_api_app(runtime, metrics, server, prompt_builder)
    limits = connection_limits(server)
    listeners = [Listener("serving", api_app, server.host, server.port, limits, connection_error_response)]
    token = resolve_control_token(config.control.control_token, config.control.control_token_file)
    if token is None:
        log.warning("no control token (TIDAL_CONTROL_TOKEN / TIDAL_CONTROL_TOKEN_FILE): the control API is off")
    else:
        control_app = control_api.build_control_app(lifecycle, token)
        control_host = config.control.control_host or server.host
        control_port = config.control.control_port
        listeners.append(
            Listener("control", control_app, control_host, control_port, limits, control_api.connection_error_response)
        )
    servers = WorkerServers(runtime, listeners, log_level=server.log_level, on_stop=[prompt_builder.close])
    return WorkerProcess(config, lifecycle, servers)
