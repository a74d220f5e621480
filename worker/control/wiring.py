"""Assembling the lifecycle manager and the control API listener from the worker's config (used by the CLI)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from tidal.worker.control.auth import resolve_control_token
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.lifecycle.metrics import LifecycleMetrics

if TYPE_CHECKING:
    from tidal.worker.config import WorkerConfig
    from tidal.worker.server.app import Listener

log = logging.getLogger(__name__)


def lifecycle_config(config: WorkerConfig) -> LifecycleConfig:
    return LifecycleConfig(
        weights_version=config.weights_version,
        weights_path=config.weights_path,
        asleep_requests=config.asleep_requests,
        retry_after_s=config.asleep_retry_after_s,
        upload_dir=config.upload_dir,
        rank=config.rank,
        world_size=config.world_size,
    )


def build_control(config: WorkerConfig, registry: CollectorRegistry) -> tuple[LifecycleManager, Listener | None]:
    """The manager always exists (it owns the weights' memory); the listener only with a token (ControlTokenError,
    a ValueError, for a token setting that is wrong)."""
    from tidal.worker.control.app import build_control_app
    from tidal.worker.server.app import Listener

    manager = LifecycleManager(lifecycle_config(config), LifecycleMetrics(registry))
    token = resolve_control_token(config.control_token, config.control_token_file)
    if token is None:
        log.warning("no control token (TIDAL_CONTROL_TOKEN / TIDAL_CONTROL_TOKEN_FILE): the control API is off")
        return manager, None
    return manager, Listener("control", build_control_app(manager, token), config.host, config.control_port)
