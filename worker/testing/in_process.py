"""A whole worker (serving API + control API, assembled as the CLI does) on a background thread, or only its
lifecycle manager and engine, in-process: for tests and demos."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from tidal.worker.config import WorkerConfig, WorkerEngineConfig
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.process import assemble_worker
from tidal.worker.server.background import BackgroundServers

_ids = itertools.count()

TEST_TOKEN = "test-control-token-0123456789abcdef"


@contextlib.contextmanager
def serving_worker(model_dir: Path, served_model_name: str, **config: Any) -> Iterator[BackgroundServers]:
    """The serving API alone (no control token) of a CPU worker in fp32, ready; stopped cleanly on exit."""
    settings = {
        "model_path": model_dir, "served_model_name": served_model_name, "device": "cpu", "dtype": "float32",
        "max_model_len": 256, "num_kv_blocks": 128, "host": "127.0.0.1", "port": 0, "log_level": "warning",
    }  # fmt: skip
    servers = BackgroundServers(assemble_worker(WorkerConfig.from_flat(**{**settings, **config})).servers)
    servers.start().wait_ready()
    try:
        yield servers
    finally:
        assert servers.stop() == 0, "the worker did not stop cleanly"


class ControlledWorker:
    """`config` takes flat field names, as the flags do (`model_path=..., num_kv_blocks=64, rank=1`)."""

    def __init__(self, **config: Any) -> None:
        settings = {"host": "127.0.0.1", "port": 0, "control_port": 0, "control_token": TEST_TOKEN, "device": "cpu"}
        self.config = WorkerConfig.from_flat(**{**settings, **config})
        self.process = assemble_worker(self.config)
        self.background = BackgroundServers(self.process.servers)
        self.api: httpx.Client | None = None
        self.control: httpx.Client | None = None

    def __enter__(self) -> ControlledWorker:
        self.background.start()
        self.api = httpx.Client(base_url=self.background.url("serving"), timeout=120)
        headers = {"Authorization": f"Bearer {TEST_TOKEN}"}
        self.control = httpx.Client(base_url=self.background.url("control"), headers=headers, timeout=120)
        self.background.wait_ready(timeout_s=120)
        return self

    def __exit__(self, *_: object) -> None:
        for client in (self.api, self.control):
            if client is not None:
                client.close()
        self.background.stop()

    def checksum(self) -> dict[str, Any]:
        """Recomputed from the served bytes, not the cached value."""
        assert self.control is not None
        response = self.control.get("/weights/checksum", params={"recompute": "true"})
        response.raise_for_status()
        checksum: dict[str, Any] = response.json()
        return checksum

    def complete(self, prompt: str | list[int], max_tokens: int = 12) -> httpx.Response:
        assert self.api is not None
        body = {"model": self.config.engine.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return self.api.post("/v1/completions", json={**body, "ignore_eos": True})

    def text(self, prompt: str | list[int], max_tokens: int = 12) -> str:
        response = self.complete(prompt, max_tokens)
        response.raise_for_status()
        text: str = response.json()["choices"][0]["text"]
        return text

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        assert self.control is not None
        return self.control.post(path, json=body if body is not None else {})


@contextlib.asynccontextmanager
async def running_manager(
    model_dir: Path, engine: dict[str, Any] | None = None, **lifecycle: Any
) -> AsyncIterator[LifecycleManager]:
    """A worker's lifecycle manager and its started engine (CPU, fp32 unless `engine` says otherwise), not serving."""
    settings = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 128, **(engine or {})}
    process = assemble_worker(
        WorkerConfig(
            engine=WorkerEngineConfig(model_path=model_dir, **settings),
            lifecycle=LifecycleConfig(**{"weights_version": "a", **lifecycle}),
        )
    )
    await process.runtime.load()
    try:
        yield process.lifecycle
    finally:
        await process.runtime.shutdown()


async def greedy(manager: LifecycleManager, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    """Greedy token ids of each prompt, all in flight together."""
    assert manager.engine is not None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in manager.engine.generate(f"greedy-{next(_ids)}", prompt, params):  # type: ignore[union-attr]
            tokens += out.new_token_ids
        return tokens

    return list(await asyncio.gather(*(one(p) for p in prompts)))
