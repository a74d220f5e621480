"""Tidal's engine vs transformers' generate() on the same CPU, the same random Llama and the same workload.

    python benchmarks/engine_vs_transformers_cpu.py [--prompts 16] [--new-tokens 64] [--hidden 256] [--layers 4]

Both generate exactly --new-tokens tokens for each of --prompts prompts (random token ids, lengths spread over
--min-len..--max-len) in fp32: the engine with continuous batching over its paged KV cache, transformers with one
left-padded batch through generate(). Each side runs --repeats times, alternating, and the best time counts (other
work on a shared machine only ever slows a run down). The engine's prefix cache is off, so a repeat reuses nothing.
Prints the wall time and generated tokens/s of each and their ratio.
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


class EngineSide:
    def __init__(self, model_dir: Path, prompts: list[list[int]], new_tokens: int) -> None:
        config = EngineConfig(
            model_path=model_dir,
            device="cpu",
            dtype="float32",
            num_kv_blocks=2048,
            max_num_seqs=256,
            enable_prefix_caching=False,
        )
        self.engine = LLMEngine.from_config(config)
        self.prompts = prompts
        self.params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        self.engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up

    def run(self) -> tuple[float, int]:
        start = time.perf_counter()
        results = self.engine.generate(self.prompts, self.params)
        return time.perf_counter() - start, sum(len(r.output_token_ids) for r in results)


class TransformersSide:
    def __init__(self, model_dir: Path, prompts: list[list[int]], new_tokens: int, pad_id: int) -> None:
        self.model = load_reference_model(model_dir)
        self.width = max(len(p) for p in prompts)
        self.num_prompts = len(prompts)
        # Left padding, so every row's new tokens start at the same column.
        self.input_ids = torch.tensor([[pad_id] * (self.width - len(p)) + p for p in prompts])
        self.mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts])
        self.kwargs = {"do_sample": False, "pad_token_id": pad_id}
        self.new_tokens = new_tokens
        self._generate(self.input_ids[:2], self.mask[:2], 4)  # warm-up

    @torch.no_grad()
    def _generate(self, input_ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        return self.model.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **self.kwargs)

    def run(self) -> tuple[float, int]:
        start = time.perf_counter()
        out = self._generate(self.input_ids, self.mask, self.new_tokens)
        return time.perf_counter() - start, (out.shape[1] - self.width) * self.num_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread by default: on a shared, oversubscribed CPU, OpenMP barriers between many small ops stall for whole
    # scheduler slices and the numbers swing by 10x; one thread gives repeatable numbers. 0 = torch's default.
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), args.hidden, args.layers)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(args.prompts, args.min_len, args.max_len, len(tokenizer), seed=0)
        tidal = EngineSide(model_dir, prompts, args.new_tokens)
        hf = TransformersSide(model_dir, prompts, args.new_tokens, tokenizer.pad_token_id)
        tidal_runs, hf_runs = [], []
        for _ in range(args.repeats):
            tidal_runs.append(tidal.run())
            hf_runs.append(hf.run())
    tidal_s, tidal_tokens = min(tidal_runs)
    hf_s, hf_tokens = min(hf_runs)
    print(
        f"workload: {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens each, "
        f"Llama hidden={args.hidden} layers={args.layers}, fp32, {torch.get_num_threads()} CPU threads, "
        f"best of {args.repeats}"
    )
    print(f"tidal engine:          {tidal_tokens} tokens in {tidal_s:6.2f}s = {tidal_tokens / tidal_s:8.1f} tokens/s")
    print(f"transformers generate: {hf_tokens} tokens in {hf_s:6.2f}s = {hf_tokens / hf_s:8.1f} tokens/s")
    print(f"ratio (tidal / transformers): {(tidal_tokens / tidal_s) / (hf_tokens / hf_s):.2f}x")


if __name__ == "__main__":
    main()
