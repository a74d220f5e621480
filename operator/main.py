"""kopf handlers, and nothing else: every handler hands its model to the one level-based reconcile."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from tidal.operator.api import constants as c
from tidal.operator.runtime.app import OperatorApp
from tidal.operator.runtime.queue import Key

KOPF_PREFIX = "kopf.tidal.dev"


def model_key(namespace: str | None, name: str) -> Key:
    """kopf types `namespace` for any resource; it is None only for cluster-scoped ones, and ours are namespaced."""
    if namespace is None:
        raise ValueError(f"{name}: a namespaced resource arrived without a namespace")
    return namespace, name


def register(registry: kopf.OperatorRegistry, app: OperatorApp) -> None:
    """Register the operator's handlers in `registry` (passed to kopf.run; nothing global is touched)."""

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The status belongs to Tidal alone: kopf keeps its bookkeeping in annotations, and posts no Events of its
        # own (ours name the transitions). Leadership comes from our Lease, so kopf runs standalone.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=KOPF_PREFIX)
        settings.posting.enabled = False
        settings.peering.standalone = True
        settings.watching.server_timeout = 300
        # kopf holds each object's events this long to batch them; our queue coalesces passes anyway, and a failed
        # rank's pod event should reach the pass that sends its survivors their epoch without a wait (0.1 s default).
        settings.batching.batch_window = 0.01
        # A stopping leader renews its Lease until its process is gone, so a successor waits for the shutdown and
        # then the Lease's expiry. kopf would allow a shutdown 600 s (the pod's grace period cuts it at 30): end a
        # hung one after a third of the Lease instead. Nothing is lost: the successor's level-based pass redoes it.
        settings.process.ultimate_exiting_timeout = app.config.lease_seconds / 3
        await app.start()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await app.stop()

    @kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL, registry=registry)
    @kopf.on.create(c.GROUP, c.VERSION, c.PLURAL, registry=registry)
    @kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, registry=registry)
    async def model_changed(namespace: str | None, name: str, **_: Any) -> None:
        await app.queue.request(model_key(namespace, name))

    @kopf.on.event(c.GROUP, c.VERSION, c.PLURAL, registry=registry)
    async def model_event(type: str | None, namespace: str | None, name: str, **_: Any) -> None:
        if type == "DELETED":
            app.forget(model_key(namespace, name))

    @kopf.on.event("", "v1", "pods", labels={c.LABEL_MODEL: kopf.PRESENT}, registry=registry)
    async def pod_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        await app.queue.request(model_key(namespace, labels[c.LABEL_MODEL]))
