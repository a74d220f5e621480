"""Operator metrics (models by phase, each model's phase) and the /healthz server, without a cluster."""

import json
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest

from tidal.operator.health import Health, serve_health
from tidal.operator.metrics import OperatorMetrics


def test_models_by_phase_follow_each_model_and_forget_deleted_ones():
    metrics = OperatorMetrics(CollectorRegistry())
    metrics.set_phase(("ns", "a"), "Ready")
    metrics.set_phase(("ns", "b"), "Ready")
    metrics.set_phase(("ns", "b"), "Sleeping")
    metrics.set_phase(("ns", "a"), None)
    metrics.reconciles.labels("ok").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'tidal_operator_models{phase="Ready"} 0.0' in text
    assert 'tidal_operator_models{phase="Sleeping"} 1.0' in text
    assert 'tidal_operator_reconciles_total{result="ok"} 1.0' in text


def test_model_phase_names_each_model_in_one_phase_and_drops_deleted_ones():
    metrics = OperatorMetrics(CollectorRegistry())
    metrics.set_phase(("ns", "a"), "Loading")
    metrics.set_phase(("ns", "a"), "Degraded")
    metrics.set_phase(("ns", "b"), "Ready")
    metrics.set_phase(("ns", "b"), None)
    lines = [line for line in generate_latest(metrics.registry).decode().splitlines() if "_model_phase{" in line]
    assert lines == ['tidal_operator_model_phase{model="a",namespace="ns",phase="Degraded"} 1.0']


def test_healthz_reports_role_and_fails_when_the_loop_stops_beating():
    health = Health(stale_after_s=0.0)
    server = serve_health(health, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        try:
            urllib.request.urlopen(url, timeout=5)
            raise AssertionError("a stale heartbeat must fail the probe")
        except urllib.error.HTTPError as err:
            assert err.code == 503
        health.stale_after_s = 60.0
        health.beat("standby")
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert json.loads(resp.read())["role"] == "standby"
    finally:
        server.shutdown()
