"""Prometheus metrics of sleep, wake and weight updates, registered on the worker's registry (passed in)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info

from tidal.contract.control_api import GroupHealth
from tidal.worker.metrics import PREFIX

OPERATIONS = ("sleep", "wake_up", "update")  # timed, and they move bytes
COUNTED_OPERATIONS = (*OPERATIONS, "reconfigure")
_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class LifecycleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sleep_level = Gauge(
            f"{PREFIX}_sleep_level", "0 while awake, else the level of the current sleep", registry=registry
        )
        self.weights_version = Info(
            f"{PREFIX}_weights_version", "Version of the weights being served", registry=registry
        )
        self.operations = Counter(
            f"{PREFIX}_lifecycle_operations", "Sleep, wake-up, weight-update and group-reconfigure calls by outcome",
            ["operation", "outcome"], registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            f"{PREFIX}_lifecycle_duration_seconds", "Duration of successful sleep, wake-up and weight updates",
            ["operation"], buckets=_BUCKETS, registry=registry,
        )  # fmt: skip
        self.bytes_moved = Counter(
            f"{PREFIX}_lifecycle_bytes_moved", "Bytes copied between host and device or read for weight updates",
            ["operation"], registry=registry,
        )  # fmt: skip
        self.group_epoch = Gauge(
            f"{PREFIX}_group_epoch", "Group membership epoch last applied by /group/reconfigure (0: never)",
            registry=registry,
        )  # fmt: skip
        self.group_size = Gauge(
            f"{PREFIX}_group_size", "Ranks of the group in the epoch last applied (the start world_size before any)",
            registry=registry,
        )  # fmt: skip
        self.group_health = Enum(
            f"{PREFIX}_group_health", "This rank in its expert-parallel group (solo: no expert parallelism)",
            states=[h.value for h in GroupHealth], registry=registry,
        )  # fmt: skip
        self.group_breaks = Counter(
            f"{PREFIX}_group_breaks", "Collectives of an expert-parallel group that failed or missed their deadline",
            registry=registry,
        )  # fmt: skip
        self.group_experts_reloaded = Counter(
            f"{PREFIX}_group_experts_reloaded", "Experts read from the checkpoint to install a group's epoch",
            registry=registry,
        )  # fmt: skip
        for op in OPERATIONS:
            self.duration.labels(operation=op)
            self.bytes_moved.labels(operation=op)
        for op in COUNTED_OPERATIONS:
            for outcome in ("ok", "error"):
                self.operations.labels(operation=op, outcome=outcome)

    def record(self, operation: str, seconds: float, num_bytes: int) -> None:
        self.operations.labels(operation=operation, outcome="ok").inc()
        self.duration.labels(operation=operation).observe(seconds)
        self.bytes_moved.labels(operation=operation).inc(num_bytes)

    def record_reconfigure(self, epoch: int | None) -> None:
        """`epoch`: the one now applied; None when the call was refused."""
        self.operations.labels(operation="reconfigure", outcome="ok" if epoch is not None else "error").inc()
        if epoch is not None:
            self.group_epoch.set(epoch)

    def set_group_size(self, group_size: int) -> None:
        self.group_size.set(group_size)

    def set_group_health(self, health: GroupHealth) -> None:
        self.group_health.state(health.value)

    def record_group_break(self) -> None:
        self.group_breaks.inc()

    def record_group_epoch(self, loaded_experts: int) -> None:
        self.group_experts_reloaded.inc(loaded_experts)

    def record_failure(self, operation: str) -> None:
        self.operations.labels(operation=operation, outcome="error").inc()

    def set_state(self, sleep_level: int, version: str | None) -> None:
        self.sleep_level.set(sleep_level)
        self.weights_version.info({"version": version or ""})
