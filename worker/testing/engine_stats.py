"""An idle engine's stats for tests of what reads them (metrics, dashboards, autoscalers), built as the real
`EngineStats` so that a new field fails those tests at construction instead of leaving a stand-in behind."""

from tidal.worker.engine.outputs import EngineStats
from tidal.worker.layers.expert_exchange import ExchangeSnapshot


def idle_engine_stats(expert_exchanges: ExchangeSnapshot | None = None) -> EngineStats:
    """Nothing running, one KV block; `expert_exchanges` as an expert-parallel rank reports them (None: no EP)."""
    return EngineStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=1, num_preemptions=0, num_prompt_tokens=0,
        num_generated_tokens=0, num_prefix_cache_hit_tokens=0, expert_exchanges=expert_exchanges,
    )  # fmt: skip
