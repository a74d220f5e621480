"""The engine on a CUDA device (Triton kernels through tidal.kernels): equality with transformers in fp32,
preemption, bf16 agreement, and KV cache sizing from a share of free GPU memory. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.engine_setup import EngineConfigError
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.step_plan import build_step_plan
from tidal.worker.testing.hf_reference import load_reference_model, prompt_ids, transformers_greedy
from tidal.worker.testing.tiny_models import TINY_ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def engine(model_dir, **config) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cuda", **config))


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_fp32_greedy_equals_transformers_with_and_without_preemption(arch, tiny_model):
    model_dir = tiny_model(arch)
    prompts = prompt_ids(model_dir)
    expected = transformers_greedy(model_dir, prompts, 16)
    roomy = engine(model_dir, dtype="float32", block_size=16, num_kv_blocks=256)
    assert [r.output_token_ids for r in roomy.generate(prompts, GREEDY)] == expected
    tight = engine(model_dir, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=96)
    assert [r.output_token_ids for r in tight.generate(prompts, GREEDY)] == expected
    assert tight.stats().num_preemptions > 0


@torch.no_grad()
def test_bf16_first_tokens_agree_with_transformers(tiny_model):
    model_dir = tiny_model("qwen3")
    prompts = prompt_ids(model_dir)
    hf = load_reference_model(model_dir, torch.bfloat16).cuda()
    expected = [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=1, do_sample=False)[0, -1].item() for p in prompts
    ]
    got = engine(model_dir, dtype="bfloat16", num_kv_blocks=128).generate(
        prompts, SamplingParams(temperature=0, max_tokens=1)
    )
    agree = sum(r.output_token_ids[0] == e for r, e in zip(got, expected, strict=True))
    assert agree >= len(prompts) - 1  # bf16 rounding differs between implementations; near-ties may flip


def test_kv_cache_sized_from_free_memory(tiny_model):
    free_before, _ = torch.cuda.mem_get_info()
    eng = engine(tiny_model("llama"), dtype="bfloat16", gpu_memory_fraction=0.02, max_num_batched_tokens=512)
    kv_bytes = eng.runner.num_kv_blocks * eng.runner.bytes_per_block
    assert 0.01 * free_before < kv_bytes <= 0.02 * free_before
    assert eng.max_model_len == 1024
    out = eng.generate(prompt_ids(tiny_model("llama"))[:2], GREEDY)
    assert all(len(r.output_token_ids) > 0 for r in out)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_cache_sized_to_all_free_memory_leaves_room_for_the_graphs(tiny_model, arch):
    """gpu_memory_fraction 1.0: the KV cache takes everything the profiled step and the estimate of the graphs'
    private pool leave, so the capture (decode and prompt graphs) and then serving must fit in what was held back."""
    model_dir = tiny_model(arch)
    eng = engine(model_dir, dtype="bfloat16", gpu_memory_fraction=1.0, max_num_seqs=16, max_model_len=512,
                 max_num_batched_tokens=256, cuda_graph_prefill_tokens=256)  # fmt: skip
    runner = eng.runner
    assert 0 < runner.graph_pool_bytes <= runner.graph_pool_estimate_bytes
    out = eng.generate(prompt_ids(model_dir), GREEDY)
    assert all(len(r.output_token_ids) > 0 for r in out)
    del eng, runner, out
    gc.collect()
    torch.cuda.empty_cache()  # the next test sizes its cache from free memory too


def test_graphs_out_of_memory_name_the_knobs(tiny_model, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ModelRunner, "capture_cuda_graphs", out_of_memory)
    with pytest.raises(EngineConfigError, match=r"lower gpu_memory_fraction \(now 0\.05\)"):
        engine(tiny_model("llama"), dtype="bfloat16", gpu_memory_fraction=0.05, max_num_seqs=4, max_model_len=256)


def test_cuda_graphs_give_the_eager_result(tiny_model):
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graphed = engine(model_dir, dtype="float32", num_kv_blocks=256, max_num_seqs=5, max_model_len=512)
    eager = engine(model_dir, dtype="float32", num_kv_blocks=256, max_num_seqs=5, max_model_len=512, enforce_eager=True)
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    assert graphed.runner.decode_graphs.sizes == [1, 2, 4, 5]
    want = [r.output_token_ids for r in eager.generate(prompts, params)]
    assert [r.output_token_ids for r in graphed.generate(prompts, params)] == want


@pytest.mark.parametrize("arch", ["llama3", "qwen3_moe"])
def test_prefill_cuda_graphs_give_the_eager_result(tiny_model, arch):
    """Steps with prompt tokens replayed from graphs captured at bucketed token counts (prefill_graphs.py), with
    chunks of up to 40 tokens beside decodes, padded to 16, 32 or 40 tokens: the eager engine's tokens, and no
    step of the graphed run left to the eager path."""
    model_dir = tiny_model(arch)
    prompts = prompt_ids(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shape = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 4, "max_model_len": 512}
    graphed = engine(model_dir, **shape, max_num_batched_tokens=40, cuda_graph_prefill_tokens=64)
    eager = engine(model_dir, **shape, max_num_batched_tokens=40, enforce_eager=True)
    assert graphed.runner.prefill_graphs is not None and eager.runner.prefill_graphs is None
    assert graphed.runner.prefill_graphs.sizes == [16, 32, 40]  # capped at max_num_batched_tokens
    assert graphed.runner.graph_pool_bytes > 0  # measured at capture, logged, reported by gpu_perf
    want = [r.output_token_ids for r in eager.generate(prompts, params)]
    calls = {"replays": 0, "eager forwards": 0}
    model, prefill_graphs = graphed.runner.model, graphed.runner.prefill_graphs
    run, forward = prefill_graphs.run, model.forward

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    prefill_graphs.run = counting("replays", run)  # type: ignore[method-assign]
    model.forward = counting("eager forwards", forward)  # type: ignore[method-assign]
    assert [r.output_token_ids for r in graphed.generate(prompts, params)] == want
    assert calls["eager forwards"] == 0 and calls["replays"] >= 2


@pytest.mark.parametrize(("arch", "weight_dtype"), [("qwen3", "auto"), ("qwen3_moe", "auto"), ("qwen3_moe", "fp8")])
def test_prefill_cuda_graphs_in_bf16_give_the_eager_logits(tiny_model, arch, weight_dtype):
    """The paths a served model takes inside prompt-step graphs (16-bit activations): the fused small-batch kernels
    with their split-K counters and PDL launches at the 16-token bucket, cuBLAS or FP8 GEMMs and the grouped expert
    GEMMs above it. Each prompt step runs through its graph, then eagerly from the same cache state on the same
    runner: the logits agree to bf16's precision (the padded row counts may pick other GEMM tiles)."""
    model_dir = tiny_model(arch)
    eng = engine(
        model_dir, dtype="bfloat16", num_kv_blocks=256, max_num_seqs=4, max_model_len=512, max_num_batched_tokens=40,
        cuda_graph_prefill_tokens=40, weight_dtype=weight_dtype,
    )  # fmt: skip
    runner, graphs = eng.runner, eng.runner.prefill_graphs
    assert graphs is not None
    for i, prompt in enumerate(prompt_ids(model_dir)):  # the short ones join decodes late: 16-token steps
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=5))
    caches = [cache for pair in runner.kv_caches for cache in pair]
    sizes = set()
    while eng.has_unfinished_requests():
        scheduled = eng.scheduler.schedule()
        plan = build_step_plan(scheduled, eng.config.block_size)
        if plan.is_decode_only:
            logits = runner.execute(plan)
        else:
            assert graphs.can_run(plan)
            before = [cache.clone() for cache in caches]
            graphed = runner.execute(plan)
            graphed = graphed.clone() if graphed is not None else None  # the graph's output is reused
            for cache, saved in zip(caches, before, strict=True):
                cache.copy_(saved)
            runner.prefill_graphs = None
            logits = runner.execute(plan)
            runner.prefill_graphs = graphs
            assert (graphed is None) == (logits is None)  # a step of prompt chunks alone samples nothing
            if logits is not None:
                torch.testing.assert_close(graphed, logits, atol=0.02 * logits.abs().max().item(), rtol=0)
            sizes.add(graphs.size_for(plan.num_tokens))
        tokens = logits.argmax(-1).tolist() if logits is not None else []
        eng.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
        for item in scheduled.scheduled:
            if item.seq.num_output_tokens >= 5:
                eng.abort_request(item.seq.request_id)
    assert 16 in sizes and len(sizes) >= 2  # the small-batch bucket and a larger one


def test_fp8_kv_cache_on_the_cuda_paths(tiny_model):
    """An FP8 cache through the Triton kernels (the fused small-batch qkv of a q/k-norm model, decode and prefill
    attention, the CUDA graphs): twice the blocks of bf16 in the same bytes, first tokens as with a bf16 cache
    (this model's K and V are around 0.5, well inside e4m3), and preemption recomputing into it (in fp32)."""
    model_dir = tiny_model("qwen3")
    prompts = prompt_ids(model_dir)
    bf16 = engine(model_dir, dtype="bfloat16", num_kv_blocks=256)
    fp8 = engine(model_dir, dtype="bfloat16", num_kv_blocks=256, kv_cache_dtype="fp8")
    assert all(k.dtype == torch.float8_e4m3fn for k, _ in fp8.runner.kv_caches)
    assert fp8.runner.bytes_per_block * 2 == bf16.runner.bytes_per_block
    first = SamplingParams(temperature=0, max_tokens=1)
    want = [r.output_token_ids for r in bf16.generate(prompts, first)]
    got = [r.output_token_ids for r in fp8.generate(prompts, first)]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(prompts) - 1
    # Decode steps and CUDA graphs over an FP8 cache, with fp32 activations (batch shapes change no bit there): a
    # sequence preempted and recomputed into the cache goes on as one that kept it.
    roomy = engine(model_dir, dtype="float32", num_kv_blocks=256, kv_cache_dtype="fp8")
    expected = [r.output_token_ids for r in roomy.generate(prompts, GREEDY)]
    tight = engine(model_dir, dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=96, kv_cache_dtype="fp8")
    assert [r.output_token_ids for r in tight.generate(prompts, GREEDY)] == expected
    assert tight.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_weights_on_the_cuda_paths(tiny_model, arch):
    """FP8 weights through the CUDA paths in bf16: the FP8 GEMM (prefill, and decode batches above 16 rows), the
    small-batch kernels over e4m3 weights (decode at up to 16 rows, graphed and eager alike), the fused qkv of a
    q/k-norm model, and for the MoE model its FP8 experts (small-batch into the residual, grouped GEMMs). Logits
    near the bf16 model's; eager and graphed decode give the same tokens."""
    model_dir = tiny_model(arch)
    prompts = prompt_ids(model_dir)
    bf16 = engine(model_dir, dtype="bfloat16", num_kv_blocks=256)
    fp8 = engine(model_dir, dtype="bfloat16", num_kv_blocks=256, weight_dtype="fp8")
    served = fp8.runner.model.checkpoint_weights()
    assert sum(t.dtype == torch.float8_e4m3fn for t in served.values()) >= 7 * 2  # 7 projections, 2+ layers
    first = SamplingParams(temperature=0, max_tokens=1)
    want = [r.output_token_ids for r in bf16.generate(prompts, first)]
    got = [r.output_token_ids for r in fp8.generate(prompts, first)]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 0.75 * len(prompts)
    eager = engine(model_dir, dtype="bfloat16", num_kv_blocks=256, weight_dtype="fp8", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    few = prompts[:5]  # a decode batch of five: the small-batch kernels
    assert [r.output_token_ids for r in fp8.generate(few, params)] == [
        r.output_token_ids for r in eager.generate(few, params)
    ]
    many = (prompts * 6)[:20]  # twenty rows: the FP8 GEMM in decode too
    assert len({tuple(r.output_token_ids) for r in fp8.generate(many, params)}) <= len(prompts)
