"""The tiny-model CLI the demo and the e2e tests use: a complete, offline-loadable model directory."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoConfig, AutoTokenizer


def test_cli_writes_a_sharded_tied_model_transformers_can_load(tmp_path):
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "qwen2", "--out", str(out)]
    result = subprocess.run([*cmd, "--sharded", "--tie-embeddings", "--seed", "3"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert "lm_head.weight" not in index["weight_map"]
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config.vocab_size
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer("any text, even ünïcode")["input_ids"]) == "any text, even ünïcode"


def test_cli_rejects_an_unknown_arch(tmp_path):
    cmd = [sys.executable, "-m", "tidal.worker.testing.tiny_models", "--arch", "gpt2", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_same_seed_same_weights(tmp_path):
    from tidal.worker.testing.tiny_models import write_tiny_model

    a = write_tiny_model("mistral", tmp_path / "a", seed=5)
    b = write_tiny_model("mistral", tmp_path / "b", seed=5)
    c = write_tiny_model("mistral", tmp_path / "c", seed=6)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
