"""`python -m tidal.operator`: config from the environment, metrics and health servers, the leader Lease, then kopf."""

from __future__ import annotations

import logging
import os
import sys

import kopf
from kubernetes import client, config
from prometheus_client import CollectorRegistry

from tidal.operator import config as operator_config
from tidal.operator.config import OperatorConfig, OperatorConfigError
from tidal.operator.health import Health, serve_health
from tidal.operator.kube.client import API_CONCURRENCY
from tidal.operator.kube.lease import LeaseElector
from tidal.operator.main import register
from tidal.operator.metrics import OperatorMetrics
from tidal.operator.runtime.app import OperatorApp

log = logging.getLogger("tidal.operator")


def _api_client() -> client.ApiClient:
    """In a cluster: the pod's ServiceAccount; elsewhere (and on the local dev cluster): $KUBECONFIG."""
    settings = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=settings)
    except config.ConfigException:
        config.load_kube_config(client_configuration=settings)
    settings.connection_pool_maxsize = API_CONCURRENCY  # urllib3 keeps this many connections to the API server
    return client.ApiClient(settings)


def usage() -> str:
    """The operator takes no arguments; its configuration is the environment the config module documents."""
    return f"usage: python -m tidal.operator\n\nConfigured by the environment:\n{operator_config.__doc__}"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv:
        print(f"tidal-operator: takes no arguments (got {argv[0]!r}); see --help", file=sys.stderr)
        return 2
    try:
        cfg = OperatorConfig.from_env(os.environ)
    except OperatorConfigError as exc:
        print(f"tidal-operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # kopf logs every handler call at INFO ("Handler ... succeeded"): with a handler per pod event that drowns the
    # operator's own lines, which say what was done and why.
    for noisy in ("kopf.objects", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    api_client = _api_client()
    metrics = OperatorMetrics(CollectorRegistry())
    health = Health()
    metrics.serve(cfg.bind_address, cfg.metrics_port)
    serve_health(health, cfg.bind_address, cfg.health_port)

    elector = LeaseElector(
        client.CoordinationV1Api(api_client), cfg.namespace, cfg.lease_name, cfg.pod_name, cfg.lease_seconds
    )
    if not elector.wait_for_leadership(on_attempt=lambda held: health.beat("leader" if held else "standby")):
        return 0
    metrics.is_leader.set(1)

    def lost() -> None:
        # Another replica may already be acting: stop this one at once, without cleanups that could still act.
        os._exit(1)

    elector.keep_renewing(on_lost=lost)
    app = OperatorApp(cfg, api_client, metrics, health)
    registry = kopf.OperatorRegistry()
    register(registry, app)
    try:
        kopf.run(
            registry=registry,
            standalone=True,
            clusterwide=not cfg.watch_namespaces,
            namespaces=cfg.watch_namespaces,
        )
    finally:
        elector.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
