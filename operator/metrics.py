"""The operator's Prometheus metrics, on their own registry (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from tidal.operator.api.status import Phase

PHASES: tuple[Phase, ...] = ("Pending", "Loading", "Ready", "Updating", "Sleeping", "Degraded", "Stopped")
_SLOW_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.reconciles = Counter(
            "tidal_operator_reconciles", "Reconcile passes by result (ok, acted, error, gone).", ["result"],
            registry=registry,
        )  # fmt: skip
        self.reconcile_seconds = Histogram(
            "tidal_operator_reconcile_duration_seconds", "Wall time of one reconcile pass, worker calls included.",
            buckets=_SLOW_BUCKETS, registry=registry,
        )  # fmt: skip
        self.models = Gauge("tidal_operator_models", "InferenceModels by status phase.", ["phase"], registry=registry)
        # One series per model, 1 for its current phase: what an alert names ("ns/model Degraded for 10 minutes"),
        # which the per-phase counts cannot.
        self.model_phase = Gauge(
            "tidal_operator_model_phase", "1 for the status phase each InferenceModel is in.",
            ["namespace", "model", "phase"], registry=registry,
        )  # fmt: skip
        self.transition_seconds = Histogram(
            "tidal_operator_sleep_wake_duration_seconds",
            "Time for every rank of a model to answer one sleep or wake (the calls run in parallel).",
            ["transition"], buckets=_SLOW_BUCKETS, registry=registry,
        )  # fmt: skip
        self.roll_seconds = Histogram(
            "tidal_operator_weight_roll_duration_seconds",
            "From the first weight update of a version to every rank serving it with one checksum.",
            buckets=_SLOW_BUCKETS, registry=registry,
        )  # fmt: skip
        self.recovery_send_seconds = Histogram(
            "tidal_operator_survivors_epoch_send_seconds",
            "From the event or timer that let a pass observe a failed expert-parallel rank to that pass sending the "
            "survivors their epoch.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5), registry=registry,
        )  # fmt: skip
        self.worker_call_errors = Counter(
            "tidal_operator_worker_call_errors", "Failed control-API calls by call.", ["call"], registry=registry
        )
        self.is_leader = Gauge(
            "tidal_operator_leader", "1 while this process holds the leader Lease.", registry=registry
        )
        # process_start_time_seconds and friends: a restart shows as a new start time.
        ProcessCollector(registry=registry)
        for transition in ("sleep", "wake"):  # defined from the start, as the call errors are (runtime/workers.py)
            self.transition_seconds.labels(transition)
        self._phases: dict[tuple[str, str], Phase] = {}
        for phase in PHASES:
            self.models.labels(phase).set(0)

    def set_phase(self, key: tuple[str, str], phase: Phase | None) -> None:
        """Record a model's phase (None: the model is gone) and refresh the per-phase counts."""
        previous = self._phases.pop(key, None)
        if previous is not None and previous != phase:
            self.model_phase.remove(*key, previous)
        if phase is not None:
            self._phases[key] = phase
            self.model_phase.labels(*key, phase).set(1)
        for p in PHASES:
            self.models.labels(p).set(sum(1 for v in self._phases.values() if v == p))

    def serve(self, address: str, port: int) -> None:
        start_http_server(port, addr=address, registry=self.registry)
