"""Serving through HTTP against the engine alone: what the HTTP layer adds to time to first token, inter-token
latency and throughput, as a measured ratio.

    python benchmarks/http_serving.py --preset llama3-8b --device cuda --streams 64   # the issue's run (H200)
    python benchmarks/http_serving.py --preset tiny --device cpu --streams 4 --smoke  # seconds, on a CPU
    python benchmarks/http_serving.py --preset llama3-8b --device cuda --switch-interval-us 5000 1000 200

One engine (random weights of the preset's shape, drawn on the device) serves the same workload twice: first
through `AsyncEngine.generate` directly, then through the worker's serving API (the app, limits and listener the
worker assembles) with the official `openai` async client streaming `/v1/completions` from client processes of their
own (one per 16 streams), as real clients are. N streams each send their
requests one after another; greedy, `ignore_eos`, a fixed number of tokens. Both sides time the same events: the
server sends an SSE event for each engine output that carries text, so the engine side counts only those too.

The model keeps the preset's shape but the tiny tokenizer's 512-token vocabulary, so that sampled tokens decode
to text and make events (with the 8B vocabulary most ids decode to nothing); its LM head is then 0.5 GB smaller.
With several `--switch-interval-us` values the pair of runs is repeated for each (the process's
`sys.setswitchinterval`, as the worker's `--gil-switch-interval-us` sets it: how long the event loop's thread may
keep the GIL while the engine's step thread waits for it, and the other way round), on the same engine.
Prints a table per value and writes benchmarks/results/http-serving-<preset>-<gpu|cpu>[-smoke].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
from perf import device as devinfo
from perf.presets import PRESETS, random_prompts, write_model_dir
from perf.random_model import build_random_model
from prometheus_client import CollectorRegistry

from tidal.worker.engine.async_engine import AsyncEngine
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.app import Listener, WorkerServers, build_api_app, connection_limits
from tidal.worker.server.background import BackgroundServers
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.errors import connection_error_response
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.runtime import WorkerRuntime

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class StreamTimes:
    """One request: when it was sent, and when each event with text arrived (time.time: the client processes share
    the clock)."""

    sent: float
    events: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the sorted values."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(requests: list[StreamTimes], tokens_per_request: int) -> dict[str, Any]:
    """TTFT and inter-event gaps (ms) at p50 / p99, and output tokens per second over the whole run."""
    timed = [r for r in requests if r.events]
    ttft = [(r.events[0] - r.sent) * 1000.0 for r in timed]
    gaps = [(b - a) * 1000.0 for r in timed for a, b in zip(r.events, r.events[1:], strict=False)]
    start = min(r.sent for r in requests)
    end = max(r.events[-1] for r in timed)
    return {
        "requests": len(requests),
        "requests_with_output": len(timed),
        "events": sum(len(r.events) for r in timed),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(gaps, 50) if gaps else None,
        "itl_ms_p99": percentile(gaps, 99) if gaps else None,
        "seconds": end - start,
        "output_tokens_per_s": len(requests) * tokens_per_request / (end - start),
    }


@dataclass(frozen=True)
class Load:
    streams: int
    requests_per_stream: int
    prompt_len: int
    max_tokens: int

    def prompts(self, vocab: int) -> list[list[int]]:
        return random_prompts(self.streams * self.requests_per_stream, self.prompt_len, vocab, seed=5)


async def engine_side(engine: AsyncEngine, load: Load, prompts: list[list[int]]) -> list[StreamTimes]:
    params = SamplingParams(temperature=0.0, max_tokens=load.max_tokens, ignore_eos=True)

    async def stream(index: int) -> list[StreamTimes]:
        out = []
        for k in range(load.requests_per_stream):
            times = StreamTimes(time.time())
            i = index * load.requests_per_stream + k
            async for output in engine.generate(f"bench-{index}-{k}", prompts[i], params):
                if output.new_text:  # what the server sends an event for
                    times.events.append(time.time())
            out.append(times)
        return out

    results = await asyncio.gather(*(stream(s) for s in range(load.streams)))
    return [t for per_stream in results for t in per_stream]


async def http_side(base_url: str, model: str, load: Load, prompts: list[list[int]]) -> list[StreamTimes]:
    pool = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=load.streams * 2))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=pool, timeout=600)

    async def stream(index: int) -> list[StreamTimes]:
        out = []
        for k in range(load.requests_per_stream):
            times = StreamTimes(time.time())
            i = index * load.requests_per_stream + k
            chunks = await client.completions.create(
                model=model, prompt=prompts[i], max_tokens=load.max_tokens, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    times.events.append(time.time())
            out.append(times)
        return out

    try:
        results = await asyncio.gather(*(stream(s) for s in range(load.streams)))
    finally:
        await client.close()
    return [t for per_stream in results for t in per_stream]


STREAMS_PER_CLIENT = 16  # one client process per this many streams: the client must not be what is measured


def http_load(base_url: str, model: str, load: Load, prompts: list[list[int]], workdir: Path) -> list[StreamTimes]:
    """`load` through the serving API from client processes of their own (the openai client parses every chunk
    into pydantic models: in the server's process it would take the GIL from the server and the engine)."""
    clients = -(-load.streams // STREAMS_PER_CLIENT)
    start_at = time.time() + 5.0  # every client starts sending then, after its imports: the streams overlap fully
    procs = []
    for c in range(clients):
        mine = range(c, load.streams, clients)
        part = Load(len(mine), load.requests_per_stream, load.prompt_len, load.max_tokens)
        rows = [prompts[s * load.requests_per_stream + k] for s in mine for k in range(load.requests_per_stream)]
        job = workdir / f"client-{c}.json"
        job.write_text(json.dumps({"base_url": base_url, "model": model, "load": asdict(part), "prompts": rows,
                                   "start_at": start_at}))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--client", str(job)], stdout=subprocess.PIPE))
    times = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"a client process failed (exit {proc.returncode})")
        times += [StreamTimes(sent, events) for sent, events in json.loads(out)]
    return times


def client_main(job_path: Path) -> None:
    """One client process: run its share of the load and print [[sent, [event times]], ...] as JSON."""
    job = json.loads(job_path.read_text())
    time.sleep(max(0.0, job["start_at"] - time.time()))
    times = asyncio.run(http_side(job["base_url"], job["model"], Load(**job["load"]), job["prompts"]))
    print(json.dumps([[t.sent, t.events] for t in times]))


def serve(engine: AsyncEngine) -> BackgroundServers:
    """The worker's serving API around `engine` on a free loopback port, on a background thread."""
    config = ServerConfig(host="127.0.0.1", port=0, log_level="warning")
    runtime = WorkerRuntime(lambda: engine)
    prompts = PromptBuilder(config.tokenizer_threads, config.allow_request_chat_template)
    app = build_api_app(runtime, WorkerMetrics(CollectorRegistry(), runtime.stats), config, prompts)
    listener = Listener("serving", app, config.host, config.port, connection_limits(config), connection_error_response)
    servers = WorkerServers(runtime, [listener], log_level=config.log_level, on_stop=[prompts.close])
    return BackgroundServers(servers).start().wait_ready(timeout_s=600)


async def run_engine_alone(llm: LLMEngine, load: Load, prompts: list[list[int]]) -> list[StreamTimes]:
    engine = AsyncEngine(llm)
    await engine.start()
    try:
        await engine_side(engine, Load(load.streams, 1, load.prompt_len, 4), prompts)  # warm-up: prefill shapes
        return await engine_side(engine, load, prompts)
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--switch-interval-us",
        type=int,
        nargs="+",
        default=[5000],
        help="sys.setswitchinterval values to compare, in µs, one engine+HTTP pair each (default: CPython's 5000)",
    )
    parser.add_argument("--smoke", action="store_true", help="a few tokens (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--client", type=Path, default=None, help=argparse.SUPPRESS)  # a client process's job file
    args = parser.parse_args(argv)
    if args.client is not None:
        client_main(args.client)
        return {}
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    load = Load(args.streams, args.requests_per_stream, args.prompt_len, 8 if args.smoke else args.max_tokens)
    preset = PRESETS[args.preset].model_copy(update={"vocab_size": None})  # the tokenizer's own 512 tokens
    env = devinfo.environment(device)
    with tempfile.TemporaryDirectory(prefix="tidal-http-") as tmp:
        model_dir = write_model_dir(preset, Path(tmp) / preset.name)
        loaded = build_random_model(model_dir, dtype, device, seed=0)
        config = EngineConfig(
            model_path=model_dir, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", device=str(device),
            max_num_seqs=load.streams, max_num_batched_tokens=max(2048, load.streams * load.prompt_len),
            enable_prefix_caching=False,
        )  # fmt: skip
        llm = LLMEngine.from_loaded_model(config, loaded)
        prompts = load.prompts(loaded.model.vocab_size)
        runs = [run_pair(llm, load, prompts, Path(tmp), us) for us in args.switch_interval_us]
    report: dict[str, Any] = {
        "benchmark": "benchmarks/http_serving.py",
        "preset": preset.name,
        "environment": env,
        "load": asdict(load),
        "runs": runs,
    }
    for run in runs:
        print(to_table(report, run) + "\n", flush=True)
    where = (env.get("gpu") or "cpu").lower().replace(" ", "-")
    stem = f"http-serving-{preset.name}-{where}" + ("-smoke" if args.smoke else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def run_pair(llm: LLMEngine, load: Load, prompts: list[list[int]], workdir: Path, switch_us: int) -> dict[str, Any]:
    """The engine alone, then through HTTP, with the process's GIL switch interval at `switch_us`."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_us / 1e6)
    try:
        engine_times = asyncio.run(run_engine_alone(llm, load, prompts))
        background = serve(AsyncEngine(llm))
        try:
            base_url = background.url("serving") + "/v1"
            model = llm.model_name
            http_load(base_url, model, Load(load.streams, 1, load.prompt_len, 4), prompts, workdir)  # warm-up
            http_times = http_load(base_url, model, load, prompts, workdir)
        finally:
            background.stop()
    finally:
        sys.setswitchinterval(default)
    engine = summarize(engine_times, load.max_tokens)
    http = summarize(http_times, load.max_tokens)
    return {"switch_interval_us": switch_us, "engine": engine, "http": http, "ratios": ratios(engine, http)}


def ratios(engine: dict[str, Any], http: dict[str, Any]) -> dict[str, float | None]:
    """HTTP over engine alone (1.05 = the HTTP layer adds 5%); throughput as engine over HTTP, so >1 is a cost too."""
    out: dict[str, float | None] = {}
    for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
        out[key] = http[key] / engine[key] if engine.get(key) and http.get(key) is not None else None
    out["throughput"] = engine["output_tokens_per_s"] / http["output_tokens_per_s"]
    return out


def to_table(report: dict[str, Any], run: dict[str, Any]) -> str:
    load, engine, http, ratio = report["load"], run["engine"], run["http"], run["ratios"]
    lines = [
        f"{report['preset']} on {report['environment'].get('gpu') or 'cpu'}: {load['streams']} streams x "
        f"{load['requests_per_stream']} requests, {load['prompt_len']} prompt tokens, {load['max_tokens']} out, "
        f"GIL switch interval {run['switch_interval_us']} µs",
        "",
        "| measure | engine alone | through HTTP | HTTP / engine |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, name in (("ttft_ms_p50", "TTFT p50 ms"), ("ttft_ms_p99", "TTFT p99 ms"),
                      ("itl_ms_p50", "inter-token p50 ms"), ("itl_ms_p99", "inter-token p99 ms")):  # fmt: skip
        value = ratio[key]
        lines.append(f"| {name} | {engine[key]:.2f} | {http[key]:.2f} | " + (f"{value:.3f}x |" if value else "— |"))
    lines.append(
        f"| output tokens/s | {engine['output_tokens_per_s']:.0f} | {http['output_tokens_per_s']:.0f} "
        f"| {1 / ratio['throughput']:.3f}x |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
