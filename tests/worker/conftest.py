"""Shared fixtures of the worker tier: tiny random models, written once per session on first use, and the openai
clients of a module's worker."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tidal.worker.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, sharded=..., tie_embeddings=...) -> model directory."""
    root = tmp_path_factory.mktemp("tiny-models")
    written: dict[str, Path] = {}

    def get(arch: str, *, sharded: bool = False, tie_embeddings: bool = False) -> Path:
        key = f"{arch}{'-sharded' if sharded else ''}{'-tied' if tie_embeddings else ''}"
        if key not in written:
            written[key] = write_tiny_model(arch, root / key, sharded=sharded, tie_embeddings=tie_embeddings)
        return written[key]

    return get


# The official openai clients of a module's worker: the module defines `worker_url` (the serving API's base URL).
@pytest.fixture(scope="module")
def client(worker_url):
    return openai.OpenAI(base_url=f"{worker_url}/v1", api_key="not-checked", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def async_client(worker_url):
    return openai.AsyncOpenAI(base_url=f"{worker_url}/v1", api_key="not-checked", max_retries=0, timeout=60)
