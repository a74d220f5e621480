"""The worker's Prometheus metrics, registered on a registry the caller passes in.

Nothing is registered at import time: each server (and each test) builds its own `WorkerMetrics` on its own
`CollectorRegistry`, so two servers in one process never collide. Request counters and latency histograms are
updated by the serving layer as requests progress; the engine's gauges (running, waiting, KV-cache usage) are read
from the engine at scrape time, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from tidal.worker.layers.expert_exchange import PHASES, ExchangeSnapshot, ExchangeTotals

PREFIX = "tidal"

# Outcomes of a request: the engine's finish reasons, plus what happens around them. "abort": the engine ended it
# (shutting down); "interrupted": a sleep or weight update in mode abort ended it, so the client got a 503 or an error
# event; "cancelled": the client went away or stopped reading first. Kept apart so a dashboard can tell the server's
# doing from the clients'.
OUTCOMES = ("stop", "length", "abort", "interrupted", "cancelled", "error", "rejected")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EngineStatsLike(Protocol):
    """What the scrape reads from the engine (tidal.worker.engine's EngineStats satisfies it). Read-only members:
    EngineStats is frozen."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_prefix_cache_hit_tokens(self) -> int: ...
    @property
    def num_grammar_mask_timeouts(self) -> int: ...
    @property
    def expert_exchanges(self) -> ExchangeSnapshot | None: ...


class _EngineCollector(Collector):
    """Reads the engine's live numbers at scrape time; reports nothing while no engine is loaded."""

    def __init__(self, read_stats: Callable[[], EngineStatsLike | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if stats is None:
            return
        yield GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests in the running batch", value=stats.num_running)
        yield GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests queued for admission", value=stats.num_waiting)
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1)", value=stats.kv_cache_usage
        )
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_blocks", "KV-cache blocks in all", value=stats.num_kv_blocks)
        yield CounterMetricFamily(
            f"{PREFIX}_preemptions", "Sequences preempted for lack of KV-cache blocks", value=stats.num_preemptions
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hit_tokens",
            "Prompt tokens whose KV was reused from the prefix cache",
            value=stats.num_prefix_cache_hit_tokens,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_grammar_mask_timeouts",
            "Structured requests ended because their grammar's token mask took longer than grammar_mask_limit_ms",
            value=stats.num_grammar_mask_timeouts,
        )
        yield from _exchange_metrics(stats.expert_exchanges)

    def describe(self) -> list[Metric]:
        # Empty: keeps the registry from calling collect() (and the engine) when the collector is registered.
        return []


# A worker without expert parallelism exchanges nothing: zeros, as the other series start, so a dashboard shows a
# flat line rather than a gap.
_NO_EXCHANGES = ExchangeSnapshot(0, tuple(ExchangeTotals(phase, 0, 0, 0, None) for phase in PHASES))


def _exchange_metrics(snapshot: ExchangeSnapshot | None) -> Iterator[Metric]:
    """An expert-parallel rank's group steps and its dispatch and combine traffic (zeros without expert
    parallelism); the seconds only where the worker times them (`--time-expert-exchanges`), so a dashboard never
    reads an untimed 0."""
    totals = (snapshot or _NO_EXCHANGES).phases
    yield CounterMetricFamily(
        f"{PREFIX}_expert_parallel_steps",
        "Steps taken in lockstep with the expert-parallel group (empty steps included)",
        value=snapshot.steps if snapshot is not None else 0,
    )
    exchanges = CounterMetricFamily(
        f"{PREFIX}_expert_exchanges", "MoE layer exchanges with the expert-parallel group, by phase", labels=["phase"]
    )
    traffic = CounterMetricFamily(
        f"{PREFIX}_expert_exchange_bytes",
        "Bytes of MoE rows (dispatch) and expert outputs (combine) to or from other ranks",
        labels=["phase", "direction"],
    )
    seconds = CounterMetricFamily(
        f"{PREFIX}_expert_exchange_seconds",
        "Time in MoE dispatch and combine collectives, peers' lateness included (only with --time-expert-exchanges)",
        labels=["phase"],
    )
    for phase in totals:
        exchanges.add_metric([phase.phase], phase.exchanges)
        traffic.add_metric([phase.phase, "sent"], phase.bytes_sent)
        traffic.add_metric([phase.phase, "received"], phase.bytes_received)
        if phase.seconds is not None:
            seconds.add_metric([phase.phase], phase.seconds)
    yield exchanges
    yield traffic
    if any(phase.seconds is not None for phase in totals):
        yield seconds


class WorkerMetrics:
    """All metrics of one worker process, on `registry`."""

    def __init__(self, registry: CollectorRegistry, read_stats: Callable[[], EngineStatsLike | None]) -> None:
        self.registry = registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=registry
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From request arrival to its last token",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(read_stats))
        # process_start_time_seconds and friends: a rank's restart (the pod's restartPolicy is Always, so its series
        # keep their labels) shows as a new start time, which the chart's alerts and dashboard count.
        ProcessCollector(registry=registry)
        # Pre-create each series so a dashboard sees zeros rather than gaps before the first request.
        for endpoint in ("completions", "chat_completions"):
            for outcome in OUTCOMES:
                self.requests.labels(endpoint=endpoint, outcome=outcome)

    def record_finished(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
