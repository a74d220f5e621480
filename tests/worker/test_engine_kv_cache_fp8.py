"""The engine with an FP8 (e4m3) KV cache on CPU: the cache's type and size, the same tokens whether or not a
sequence was preempted and recomputed into it, and the config's names. Accuracy on real weights is in
test_smollm2_vs_transformers.py; the kernels' rounding in tests/kernels/test_kv_cache_fp8.py."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from tidal.kernels.kv_cache_dtype import FP8_E4M3, FP8_NAMES
from tidal.worker.engine.config import EngineConfig, KVCacheDType
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def engine(model_dir, **config) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", dtype="float32", **config))


def test_config_names_are_the_kernels_names():
    """One set of names: the kernels' (FP8_NAMES), the engine config's and the CRD's (`spec.model.kvCacheDtype`)."""
    from tidal.operator.api.spec import KvCacheDtype

    assert get_args(KVCacheDType) == get_args(KvCacheDtype) == ("auto", *FP8_NAMES)
    with pytest.raises(ValidationError, match="fp8_e4m3"):
        EngineConfig(model_path="m", kv_cache_dtype="int8")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_cache_holds_four_times_the_fp32_tokens_and_survives_preemption(arch, tiny_model):
    """The same bytes hold 4x the blocks of an fp32 cache. A sequence preempted and recomputed writes the same e4m3
    values again, so a tight cache (preemptions) and a roomy one give the same greedy tokens."""
    model_dir = tiny_model(arch)
    prompts = prompt_ids(model_dir)
    fp32 = engine(model_dir, kv_cache_bytes=4 * 2**20)
    fp8 = engine(model_dir, kv_cache_bytes=4 * 2**20, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache_dtype == FP8_E4M3
    assert all(k.dtype == v.dtype == FP8_E4M3 for k, v in fp8.runner.kv_caches)
    assert fp8.runner.bytes_per_block * 4 == fp32.runner.bytes_per_block
    assert fp8.runner.num_kv_blocks == 4 * fp32.runner.num_kv_blocks
    roomy = [r.output_token_ids for r in fp8.generate(prompts, GREEDY)]
    tight = engine(model_dir, block_size=4, num_kv_blocks=24, max_model_len=96, kv_cache_dtype="fp8")
    assert [r.output_token_ids for r in tight.generate(prompts, GREEDY)] == roomy
    assert tight.stats().num_preemptions > 0
    written = torch.stack([k.float().abs().sum() for k, _ in fp8.runner.kv_caches])
    assert (written > 0).all()  # every layer's cache got the prompts' keys
