"""Random engine configurations and request mixes, run with and without async scheduling: every request's delta
stream must be the same. Where no sequence can end on a token the batches must be the same too (checked through
the stats and through unseeded sampling, which draws from one generator shared by each batch). Where they can,
some requests are also aborted once they have a given number of tokens (with the async engine, while a step that
computes their next token is in flight)."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams

SEEDS = range(8)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


Arrival = tuple[int, list[int], SamplingParams, int | None]  # call of step(), prompt, params, abort after N tokens


def scenario(seed: int) -> tuple[dict, list[Arrival], bool]:
    """-> engine config, arrivals, whether sequences may end on a token."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = rng.choice([48, 64, 96])
    config = {
        "block_size": block_size,
        # From "preempts often" to "never preempts"; a sequence must always fit on its own.
        "num_kv_blocks": max(max_model_len // block_size + 1, rng.choice([12, 24, 200]) * 4 // block_size),
        "max_num_seqs": rng.choice([2, 4, 16]),
        "max_num_batched_tokens": rng.choice([5, 16, 256]),
        "enable_prefix_caching": rng.random() < 0.7,
        "max_model_len": max_model_len,
        "seed": seed,
    }
    token_stops = rng.random() < 0.5
    shared = [rng.randrange(4, 500) for _ in range(24)]
    arrivals = []
    for _ in range(rng.randrange(4, 12)):
        prefix = shared[: rng.randrange(0, 24)] if rng.random() < 0.5 else []
        prompt = (prefix + [rng.randrange(4, 500) for _ in range(rng.randrange(1, 30))])[: max_model_len - 1]
        kind = rng.choice(["greedy", "seeded"] if token_stops else ["greedy", "seeded", "unseeded"])
        params = {
            "temperature": 0.0 if kind == "greedy" else rng.choice([0.7, 1.0, 1.3]),
            "top_k": rng.choice([-1, -1, 5, 50]),
            "top_p": rng.choice([1.0, 1.0, 0.8]),
            "seed": rng.randrange(1000) if kind == "seeded" else None,
            "max_tokens": rng.choice([None, 1, 2, 5, 12, 30]),
            "ignore_eos": not token_stops or rng.random() < 0.3,
        }
        if token_stops and rng.random() < 0.6:
            params["stop_token_ids"] = rng.sample(range(4, 500), 40)  # likely to come up within a few tokens
        abort_after = rng.randrange(1, 6) if token_stops and rng.random() < 0.25 else None
        arrivals.append((rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 21]), prompt, SamplingParams(**params), abort_after))
    return config, arrivals, token_stops


def run(model_dir, config: dict, arrivals, async_scheduling: bool) -> tuple[dict[str, list[tuple]], dict]:
    engine = LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", async_scheduling=async_scheduling, **config)
    )
    queue = sorted((arrival[0], i) for i, arrival in enumerate(arrivals))
    streams: dict[str, list[tuple]] = defaultdict(list)
    calls = 0
    while queue or engine.has_unfinished_requests():
        while queue and queue[0][0] <= calls:
            _, i = queue.pop(0)
            engine.add_request(f"r{i}", arrivals[i][1], arrivals[i][2])
        for out in engine.step():
            streams[out.request_id].append(tuple(out))
            abort_after = arrivals[int(out.request_id[1:])][3]
            if out.finish_reason is None and abort_after == out.num_output_tokens:
                [final] = engine.abort_request(out.request_id)
                assert final.num_output_tokens == abort_after
                streams[out.request_id].append(tuple(final))
        calls += 1
        assert calls < 5000, "no progress"
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and not engine.has_step_in_flight
    return dict(streams), stats.model_dump()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workloads_give_the_synchronous_streams(model_dir, seed):
    config, arrivals, token_stops = scenario(seed)
    want, want_stats = run(model_dir, config, arrivals, async_scheduling=False)
    got, got_stats = run(model_dir, config, arrivals, async_scheduling=True)
    assert len(want) == len(arrivals)
    assert got == want
    if not token_stops:
        assert got_stats == want_stats
