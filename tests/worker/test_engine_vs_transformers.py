"""Acceptance: for every architecture the engine's greedy output equals transformers', token for token, for
prompts of different lengths submitted together; also when the KV cache is so small that sequences are
preempted and recomputed, and when the token budget splits prefills into chunks."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import load_reference_model, prompt_ids, transformers_greedy
from tidal.worker.testing.tiny_models import TINY_ARCHS

ARCHS = sorted(TINY_ARCHS)

MAX_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(tiny_model):
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(arch: str) -> tuple[list[list[int]], list[list[int]]]:
        if arch not in cache:
            model_dir = tiny_model(arch)
            prompts = prompt_ids(model_dir)
            cache[arch] = (prompts, transformers_greedy(model_dir, prompts, MAX_NEW_TOKENS))
        return cache[arch]

    return get


def run_engine(model_dir, prompts, **config) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", dtype="float32", **config))
    results = engine.generate(prompts, GREEDY)
    return [r.output_token_ids for r in results], engine


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(arch, tiny_model, reference):
    prompts, expected = reference(arch)
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 6
    got, engine = run_engine(tiny_model(arch), prompts, block_size=4, num_kv_blocks=256)
    assert got == expected
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    # Again on the same engine: the prompts' blocks now come from the prefix cache, and nothing changes.
    again = [r.output_token_ids for r in engine.generate(prompts, GREEDY)]
    assert engine.stats().num_prefix_cache_hit_tokens > stats.num_prefix_cache_hit_tokens + 100
    assert again == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_with_preemption(arch, tiny_model, reference):
    prompts, expected = reference(arch)
    # 24 blocks of 4 = 96 tokens for 9 sequences of up to ~45 + 16 tokens: they cannot all stay.
    got, engine = run_engine(tiny_model(arch), prompts, block_size=4, num_kv_blocks=24, max_model_len=96)
    assert engine.stats().num_preemptions > 0
    assert got == expected


# llama3 for its rope scaling; the mixtures of experts because routing is per token, so a chunk boundary must not
# change which experts a prompt's tokens take.
@pytest.mark.parametrize("arch", ["llama3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_equals_transformers_with_chunked_prefill_and_no_prefix_cache(arch, tiny_model, reference):
    prompts, expected = reference(arch)
    got, engine = run_engine(
        tiny_model(arch),
        prompts,
        block_size=8,
        num_kv_blocks=128,
        max_num_batched_tokens=7,
        max_num_seqs=3,
        enable_prefix_caching=False,
    )
    assert got == expected
    assert engine.stats().num_prefix_cache_hit_tokens == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_first_tokens_agree_with_transformers(dtype, tiny_model):
    model_dir = tiny_model("qwen2")
    prompts = prompt_ids(model_dir)
    hf = load_reference_model(model_dir, getattr(torch, dtype))
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0, -1].argmax().item() for p in prompts]
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, num_kv_blocks=64))
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    agree = sum(r.output_token_ids == [e] for r, e in zip(got, expected, strict=True))
    assert agree >= len(prompts) - 1  # rounding differs between implementations; a near-tie may flip


@torch.no_grad()
def test_the_reference_is_the_plain_forward_argmax_for_a_prompt_holding_the_pad_id(tiny_model):
    """A prompt may hold the pad id (an ordinary token to the engine; random ids hit the tiny models' pad, 4):
    transformers' greedy tokens are still those its plain causal forward picks, and the engine's."""
    model_dir = tiny_model("llama")
    hf = load_reference_model(model_dir)
    rng = random.Random(0)
    prompt = [rng.randint(5, 300) for _ in range(28)]
    prompt[3] = prompt[12] = prompt[20] = hf.config.pad_token_id
    [answer] = transformers_greedy(model_dir, [prompt], 4)
    logits = hf(torch.tensor([prompt + answer])).logits[0]  # [len(prompt) + 4, vocab_size]
    assert answer == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    got, _ = run_engine(model_dir, [prompt], num_kv_blocks=16, max_model_len=32)
    assert got == [answer]
