"""Tidal's engine vs transformers' generate() on the same CPU, the same random Llama and the same workload.

    python benchmarks/engine_vs_transformers_cpu.py [--prompts 16] [--new-tokens 64] [--hidden 256] [--layers 4]

Both generate exactly --new-tokens tokens for each of --prompts prompts (random token ids, lengths spread over
--min-len..--max-len) in fp32: the engine with continuous batching over its paged KV cache, transformers with one
left-padded batch through generate(). Prints the wall time and generated tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import load_reference_model
from tidal.worker.testing.tiny_models import write_tiny_model


def make_model(root: Path, hidden: int, layers: int) -> Path:
    heads = max(hidden // 64, 2)
    overrides = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 2, 1),
        "head_dim": hidden // heads,
    }
    return write_tiny_model("llama", root / "bench-llama", config_overrides=overrides)


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_engine(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    config = EngineConfig(model_path=model_dir, device="cpu", dtype="float32", num_kv_blocks=2048, max_num_seqs=256)
    engine = LLMEngine.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.output_token_ids) for r in results)


@torch.no_grad()
def run_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, int]:
    model = load_reference_model(model_dir)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad_id}
    model.generate(
        input_ids[:2], attention_mask=attention_mask[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
    )
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - width) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), args.hidden, args.layers)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(args.prompts, args.min_len, args.max_len, len(tokenizer), seed=0)
        tidal_s, tidal_tokens = run_engine(model_dir, prompts, args.new_tokens)
        hf_s, hf_tokens = run_transformers(model_dir, prompts, args.new_tokens, tokenizer.pad_token_id)
    print(
        f"workload: {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens each, "
        f"Llama hidden={args.hidden} layers={args.layers}, fp32, {torch.get_num_threads()} CPU threads"
    )
    print(f"tidal engine:          {tidal_tokens} tokens in {tidal_s:6.2f}s = {tidal_tokens / tidal_s:8.1f} tokens/s")
    print(f"transformers generate: {hf_tokens} tokens in {hf_s:6.2f}s = {hf_tokens / hf_s:8.1f} tokens/s")
    print(f"ratio (tidal / transformers): {(tidal_tokens / tidal_s) / (hf_tokens / hf_s):.2f}x")


if __name__ == "__main__":
    main()
